"""A trainer killed mid-run and restarted by `tandem up`, and a run stopped with SIGTERM and
continued with `--resume`, both end with the learner holding exactly the steps the master
counted, every task consumed once in the final lineage, and no checkpoint overwritten."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Self

import pytest
import yaml


import resume_check
from processes import alive, freeze, wait_for
from tandem.common.messages import (
    LeaseExpired,
    TrainerResumed,
    WeightsPublished,
)
from tandem.common.trace import JsonlTail
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
STEPS = 8


def component_pid(up_pid: int, name: str) -> int | None:
    for pid in resume_check.children_of(up_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"tandem-{name}" in cmd:
            return pid
    return None




def newest_published(run_dir: Path, *, since_resume: int = 0) -> int:
    """The newest version announced after the `since_resume`-th TrainerResumed (0: from the
    start), -1 if none."""
    records = resume_check.journal(run_dir)
    resumes = [i for i, r in enumerate(records) if isinstance(r, TrainerResumed)]
    if len(resumes) < since_resume:
        return -1
    first = resumes[since_resume - 1] if since_resume else 0
    return max((r.version for r in records[first:] if isinstance(r, WeightsPublished)),
               default=-1)


def logged(log: Path, event: str) -> list[dict]:
    return [e for e in JsonlTail().new_objects(log) if e.get("event") == event]


class Held:
    """Components held still with SIGSTOP (`processes.freeze`); on exit whatever is still
    held goes on, so a failing test leaves nothing stopped behind."""

    def __init__(self) -> None:
        self.pids: set[int] = set()

    def __enter__(self) -> Self:
        return self

    def hold(self, pid: int) -> None:
        freeze(pid)
        self.pids.add(pid)

    def both_started(self, proc, trainer_log: Path) -> tuple[int, int]:
        """The explorer and the trainer of `tandem up` process `proc`, both held: the explorer
        while it still starts up, the trainer once it has started."""
        explorer = wait_for(lambda: component_pid(proc.pid, "explorer"), BACKSTOP, "the explorer")
        self.hold(explorer)
        trainer = wait_for(lambda: component_pid(proc.pid, "trainer"), BACKSTOP, "the trainer")
        wait_for(lambda: logged(trainer_log, "trainer.started"), BACKSTOP, "the trainer's start")
        self.hold(trainer)
        return explorer, trainer

    def release(self, pid: int) -> None:
        self.pids.discard(pid)
        os.kill(pid, signal.SIGCONT)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self.pids.discard(pid)

    def __exit__(self, *exc: object) -> None:
        for pid in list(self.pids):
            try:
                self.release(pid)
            except ProcessLookupError:
                pass


def test_a_killed_trainer_restarted_by_up_resumes_from_its_checkpoint_and_retrains_once(
        tmp_path, tiny_model_dir):
    """The kill lands where the test chooses, however fast the machine: the plan is
    synchronous (batch t rolls out with version t, step t trains on batch t), so with the
    explorer frozen the trainer can train no step beyond the batches there are, and with the
    trainer frozen the explorer can roll out no batch beyond the versions there are. Thawing
    one at a time, each until the run itself shows it can go no further, moves the run one
    batch or one step at a time to a trainer idle after step 3: 4 steps counted, the newest
    checkpoint at 3, the next one due at 6. It is killed there, frozen."""
    config = resume_check.write_config(tmp_path, tiny_model_dir, preset="synchronous",
                                       steps=STEPS, seed=0, run_timeout=BACKSTOP)
    data = yaml.safe_load(config.read_text())
    data["sync"].update({"method": "checkpoint", "timeout": BACKSTOP})
    data["transport"]["liveness"] = 300.0  # a frozen component is not a dead one
    data["trainer"]["checkpoint_every"] = 3
    data["up"].update({"restart": "on-failure", "max_restarts": 2})
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    trainer_log = run_dir / "logs" / "trainer.jsonl"

    def trainer_can_go_no_further() -> bool:
        """It trained every batch there is, announced the version after it and wrote the
        checkpoint due at it: it can only wait for the next batch."""
        counted = resume_check.master_steps(run_dir)
        if counted == 0:
            return resume_check.batches_done(run_dir) == 0
        return (counted == resume_check.batches_done(run_dir) and newest_published(run_dir) >= counted
                and (counted % 3 or resume_check.newest_checkpoint_step(run_dir) == counted))

    proc = resume_check.up_process(config)
    try:
        with Held() as held:
            explorer, trainer = held.both_started(proc, trainer_log)
            while True:
                held.release(trainer)
                wait_for(trainer_can_go_no_further, BACKSTOP, "the trainer to train every batch")
                held.hold(trainer)
                killed_at = resume_check.master_steps(run_dir)
                if killed_at > 3 and killed_at % 3:  # between two checkpoints
                    break
                held.release(explorer)
                wait_for(lambda k=killed_at: resume_check.batches_done(run_dir) == k + 1, BACKSTOP, "the next batch")
                held.hold(explorer)
            checkpoint = resume_check.newest_checkpoint_step(run_dir)
            held.kill(trainer)
            # the explorer stays frozen until the restarted trainer announced again the
            # version it waits for: it never looks for the lost lineage's copy, which the
            # restart moves aside
            wait_for(lambda: newest_published(run_dir, since_resume=2) >= killed_at, BACKSTOP,
                     "the restarted trainer to train the lost steps again")
        code, out = resume_check.finish(proc, BACKSTOP)
    finally:
        if proc.poll() is None:
            resume_check.kill_everything(proc)
    assert "restarting trainer (1/2)" in out and "restarting trainer (2/2)" not in out
    assert code == 0, out[-3000:]
    report = resume_check.account(run_dir, groups_per_step=2)
    assert report["learner_steps"] == report["master_steps"] == STEPS, report
    assert report["groups_consumed"] == STEPS * 2
    assert report["tasks_trained_twice"] == 0 and report["steps_with_wrong_group_count"] == 0
    assert report["uses_of_unknown_groups"] == 0 and report["checkpoints_overwritten"] == 0
    # the newest checkpoint is the one due before the kill (3 when the run was frozen from its
    # start, as it is unless this test was held up for the explorer's whole start-up)
    assert checkpoint == killed_at - killed_at % 3
    events = [e for e in resume_check.log_events(run_dir) if e["_file"] == "trainer"]
    starts = [i for i, e in enumerate(events) if e.get("event") == "trainer.resume"]
    assert [events[i]["step"] for i in starts] == [0, checkpoint], [events[i] for i in starts]
    restarted = events[starts[-1]]
    assert restarted["master_counted"] == killed_at
    assert restarted["detail"] == (
        f"resumed from checkpoint {run_dir / 'checkpoints' / f'step_{checkpoint:08d}'}; master "
        f"had counted {killed_at}; retraining {checkpoint}..{killed_at - 1}")
    # each lineage trained its steps in order, each once: the killed one up to the kill, the
    # restarted one from its checkpoint to the end
    trained = [[e["step"] for e in events[a:b] if e.get("event") == "train.step"]
               for a, b in zip(starts, [*starts[1:], len(events)])]
    assert trained == [list(range(killed_at)), list(range(checkpoint, STEPS))], trained
    assert not any(e.get("event") == "trainer.step_mismatch" for e in events)


def test_sigterm_then_resume_finishes_every_step_without_waiting_for_stale_leases(
        tmp_path, tiny_model_dir):
    """The short resume check of `make test`: default settings, so the only checkpoint is the
    one the trainer writes when it is stopped.

    The stop lands where the test chooses, however fast the machine (a tiny model trains a
    step in tens of milliseconds: unheld, the whole run can end before a SIGTERM does). The
    plan's staleness bound holds the run: with the trainer frozen the explorer rolls out at
    most `sync.max_staleness` batches ahead of the newest version, and with the explorer
    frozen the trainer trains at most the batches there are. So: the explorer rolls out its
    first batches while the trainer is frozen, the trainer trains them while the explorer is
    frozen, and then, the trainer frozen, `tandem up` gets SIGTERM and stops the explorer
    (the first stage of its stop); thawed, the trainer can train at most the few batches the
    bound let through before it stops on its own SIGTERM, far below the run's steps."""
    steps = 30
    config = resume_check.write_config(tmp_path, tiny_model_dir, preset="fully_async",
                                       steps=steps, seed=0, run_timeout=BACKSTOP)
    data = yaml.safe_load(config.read_text())
    data["transport"]["liveness"] = 300.0  # a frozen component is not a dead one
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    trainer_log = run_dir / "logs" / "trainer.jsonl"
    proc = resume_check.up_process(config)
    try:
        with Held() as held:
            explorer, trainer = held.both_started(proc, trainer_log)
            held.release(explorer)
            wait_for(lambda: resume_check.batches_done(run_dir) >= 3, BACKSTOP, "three batches")
            held.hold(explorer)
            held.release(trainer)
            wait_for(lambda: resume_check.master_steps(run_dir) == resume_check.batches_done(run_dir), BACKSTOP,
                     "the trainer to train every batch")
            held.hold(trainer)
            interrupted_at = resume_check.master_steps(run_dir)
            proc.send_signal(signal.SIGTERM)
            held.release(explorer)
            wait_for(lambda: not alive(explorer), BACKSTOP, "`tandem up` to stop the explorer")
        first_code, first_out = resume_check.finish(proc, BACKSTOP)
    finally:
        if proc.poll() is None:
            resume_check.kill_everything(proc)
    counted_at_stop = resume_check.master_steps(run_dir)
    checkpoint_at_stop = resume_check.newest_checkpoint_step(run_dir)
    # stopped by the signal, every component on its own SIGTERM (none had to be killed)
    assert first_code == 130 and "up.kill" not in first_out, first_out[-3000:]
    # the stop was not a loss: the trainer checkpointed every step the master had counted
    assert 3 <= interrupted_at <= counted_at_stop == checkpoint_at_stop < steps
    proc = resume_check.up_process(config, "--resume")
    try:
        code, out = resume_check.finish(proc, BACKSTOP)
    finally:
        if proc.poll() is None:
            resume_check.kill_everything(proc)
    report = {"total_steps": steps, "exit_code": code,
              **resume_check.account(run_dir, groups_per_step=2)}
    assert resume_check.verdict(report, None) == [], (report, out[-3000:])
    retrain_log = [e.get("detail") for e in resume_check.log_events(run_dir)
                   if e.get("event") == "trainer.resume"]
    assert retrain_log[-1] == (
        f"resumed from checkpoint {run_dir / 'checkpoints' / f'step_{checkpoint_at_stop:08d}'}; "
        f"the master counted the same {checkpoint_at_stop} steps")
    # The resumed run waited for no lease of the stopped one, however long it took: the
    # stopped trainer's (buffer.lease_seconds: 120 s) was released by its successor and the
    # explorers' tasks (master.task_lease_seconds) were handed back, so none ran out. Waiting
    # for one would show as its expiry, in the buffer's log or the master's journal.
    expired = [e for e in resume_check.log_events(run_dir)
               if e.get("event") == "buffer.leases_expired"]
    assert expired == [], expired
    assert [r for r in resume_check.journal(run_dir) if isinstance(r, LeaseExpired)] == []


def test_kill_all_and_resume_three_times_never_names_a_version_set_aside(tmp_path,
                                                                          tiny_model_dir):
    """Issue 32 item 5: after a SIGKILL of everything the master replays versions of a lineage
    the resumed trainer (from model.path: no checkpoint was written) moves aside. Each kill
    lands once the trainer of that incarnation counted 2, 4 and 6 steps (frozen at once, so
    it steps no further), each `--resume` with the default `up.restart`; no explorer is told
    to load a version that is gone, and the run ends with every step trained once."""
    steps = 14
    report = resume_check.run_scenario(tmp_path, tiny_model_dir, "fully_async",
                                       "sigkill-cycles", steps=steps, stop_at=2, seed=0,
                                       run_timeout=BACKSTOP)
    cycles = report["cycles"]
    assert [c.get("killed_at") is not None for c in cycles] == [True] * 3 + [False], cycles
    assert report["versions_not_found"] == 0, report.get("output_tail")
    assert resume_check.verdict(report, None) == [], (report, report.get("output_tail"))
    # Each incarnation's kill waited for its own trainer (the journal's records after the
    # killed one's), so each with steps left had one, which logged how it resumed. A kill
    # that still landed after the final checkpoint (the freeze comes after the count is read)
    # leaves the next `--resume` a finished run: it starts nothing.
    expected = [[0]] + [[] if c["checkpoint"] == steps else [0] for c in cycles[:-1]]
    assert [c["trainers_resumed"] for c in cycles] == expected, cycles
    assert len(report["retrain_log"]) == sum(map(len, expected)), report["retrain_log"]
