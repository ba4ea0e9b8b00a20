"""`tandem up` shows evaluations: the rows an explorer appends to run_dir/eval.jsonl, read as
they arrive (a half-written last line waits for the next look)."""

from __future__ import annotations

import json
import time

from backstop import BACKSTOP
from tandem.master.up import Progress, headline


def test_progress_reads_eval_rows_as_they_arrive(tmp_path):
    row = {"version": 0, "taskset": "heldout", "metrics": {
        "greedy/reward_mean": 0.4, "greedy/accuracy": 0.4, "sampled/accuracy": 0.25,
        "sampled/pass@1": 0.25, "sampled/pass@4": 0.5}}
    later = dict(row, version=50, metrics=dict(row["metrics"], **{"greedy/accuracy": 0.75}))
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(later)[:20])  # the second half-written
    progress = Progress()
    progress.update_from_evals(tmp_path)
    assert [r["version"] for r in progress.evals] == [0]
    assert progress.eval_text() == "heldout v0: greedy acc 0.40, sampled acc 0.25, " \
                                   "sampled/pass@4 0.50"
    path.write_text(json.dumps(row) + "\n" + json.dumps(later) + "\n")
    progress.update_from_evals(tmp_path)
    assert [r["version"] for r in progress.evals] == [0, 50]
    assert progress.eval_text().startswith("heldout v50: greedy acc 0.75")
    assert headline({"sampled/pass@1": 0.1, "sampled/pass@16": 0.9}) == "sampled/pass@16 0.90"


def test_free_addresses_leave_the_metrics_ports_free_too():
    """`run_up` from Python (the quickstart) gives every loopback address a free port; the
    metrics ports stay unset, so `prepare` picks free ones too and two runs never clash."""
    from tandem.common.config import RunConfig
    from tandem.master.up import resolve_addresses

    config = resolve_addresses(RunConfig.model_validate({"logging": {"level": "warning"}}))
    assert "port" not in config.logging.metrics.model_fields_set
    assert config.master.address != RunConfig().master.address
    pinned = resolve_addresses(RunConfig.model_validate({"logging": {"metrics": {"port": 9500}}}))
    assert pinned.logging.metrics.port == 9500


def test_the_end_of_a_run_waits_for_the_clients_not_for_the_servers(tmp_path):
    """After the master's Stop the explorers and the trainer end on their own; the buffer is a
    server that never does, so `_finish` must not wait `up.stop_timeout` for it (it did: dead
    time at the end of every run, a minute with an evaluating explorer's `eval.final_wait`)."""
    import sys
    import threading

    from tandem.common.config import RunConfig
    from tandem.master.up import Child, Supervisor

    # the buffer serves until this file appears, and up.stop_timeout is an hour: a _finish
    # that waited for it would not return while the buffer runs, however fast the machine
    released = tmp_path / "buffer-may-exit"
    sup = Supervisor(RunConfig.model_validate(
        {"run_dir": str(tmp_path), "up": {"stop_timeout": 3600},
         "logging": {"level": "warning"}}), live=False)
    quick = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    serving = [sys.executable, "-c", "import os, sys, time\n"
               "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)", str(released)]
    sup.children = [Child(name, role, argv, tmp_path / f"{name}.out") for name, role, argv in [
        ("master", "master", [sys.executable, "-c", "pass"]),
        ("buffer", "buffer", serving),
        ("trainer", "trainer", quick), ("explorer-0", "explorer", quick)]]
    for child in sup.children:
        child.start()
    finishing = threading.Thread(target=sup._finish, daemon=True)
    try:
        sup.children[0].proc.wait(BACKSTOP)
        finishing.start()
        finishing.join(BACKSTOP)  # only bounds a hang: up waits an hour for the buffer
        assert not finishing.is_alive(), "_finish waited for the buffer"
        assert [c.returncode for c in sup.children[2:]] == [0, 0]  # the clients ended first
        assert sup.children[1].returncode is None
    finally:
        released.write_text("")
        if finishing.ident is not None:
            finishing.join(BACKSTOP)
        sup._stop_all()
    assert all(c.returncode is not None for c in sup.children)


def test_a_component_that_exits_on_the_stop_before_up_polls_it_is_not_a_failure(tmp_path):
    """An explorer ends on the master's Stop as soon as it sees it; up polls the master's
    status every half second. A zero exit judged before that poll was reported as a failure
    ("explorer-0 exited with code 0", result failed) after every step had trained: up asks the
    master before it judges a zero exit."""
    import asyncio
    import sys

    from tandem.common.config import RunConfig
    from tandem.common.messages import GetStatus, RunCounters, Status
    from tandem.master.up import Child, Supervisor

    sup = Supervisor(RunConfig.model_validate(
        {"run_dir": str(tmp_path), "up": {"restart": "never", "stop_timeout": 5},
         "logging": {"level": "warning"}}), live=False)
    sup.children = [
        Child("master", "master", [sys.executable, "-c", f"import time; time.sleep({BACKSTOP})"],
              tmp_path / "master.out"),
        Child("explorer-0", "explorer", [sys.executable, "-c", "pass"], tmp_path / "e.out")]
    for child in sup.children:
        child.start()
    sup.children[1].proc.wait(BACKSTOP)  # it saw the Stop and left; up has not polled since

    class Master:
        async def call(self, msg, **kw):
            assert isinstance(msg, GetStatus)
            return Status.model_construct(run_id="r", counters=RunCounters.model_construct(
                stopped=True, total_steps=2, trainer_steps_done=2, trainer_steps_released=2,
                newest_version=2, batches_granted=2, batches_done=2, batches_lost=0,
                explorers_alive=0))

    async def watch() -> int:
        task = asyncio.create_task(sup._watch(Master(), GetStatus))
        deadline = time.monotonic() + BACKSTOP  # a hang's bound: the verdict is the first look
        while not (task.done() or sup.children[1].finished) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        sup._stop_reason = "test over"
        return await asyncio.wait_for(task, BACKSTOP)

    try:
        code = asyncio.run(watch())
    finally:
        sup._stop_all()
    assert sup.children[1].finished and code == 130
