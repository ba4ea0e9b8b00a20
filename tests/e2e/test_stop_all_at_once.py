"""Every component SIGTERMed at once, as `kubectl delete` and a plain `scancel` do (issue 32
item 1): the master and the buffer are gone while the explorer and the trainer still report, and
each of those calls is one attempt bounded by `transport.liveness`; a peer that left one
unanswered costs nothing more. Before the fix the trainer's exit checkpoint reports waited
`rpc_retries + 1` x `rpc_timeout` for the master (on a Slurm cluster torchrun SIGKILLed it).

The moment comes from the master's journal: the explorer leased step 2's tasks, so (synchronous,
weights by checkpoint) the trainer has counted and published step 1 and waits for a TrainerGo.
The trainer and the explorer are frozen there (SIGSTOP), all four get SIGTERM, and the frozen two
go on only once the master and the buffer have exited: the worst order of a stop at once, made
certain rather than raced. The verdict is read from the components' own logs: exit codes, the
checkpoint, and each call a stopping component made (`rpc.stopping_call`, with its attempts and
the bound it ran under), never the wall time of a busy machine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml


import bench_stop
from processes import freeze
from tandem.common.sockets import free_port
from tandem.common.trace import JsonlTail
from backstop import BACKSTOP

BIN = Path(sys.executable).parent
LIVENESS = 5.0  # the stop bound per peer


def write_config(tmp_path: Path, model_dir: Path) -> Path:
    path = bench_stop.write_config(tmp_path, model_dir, "synchronous", sync_timeout=BACKSTOP)
    config = yaml.safe_load(path.read_text())
    config["sync"]["method"] = "checkpoint"
    config["master"].update(address=f"tcp://127.0.0.1:{free_port()}",
                            publish_address=f"tcp://127.0.0.1:{free_port()}")
    config["buffer"] = {"address": f"tcp://127.0.0.1:{free_port()}"}
    config["transport"] = {"liveness": LIVENESS}
    config["trainer"]["checkpoint_every"] = 0  # the exit checkpoint is the one under test
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def events(run_dir: Path, name: str) -> list[dict]:
    return list(JsonlTail().new_objects(run_dir / "logs" / f"{name}.jsonl"))


def test_every_component_signalled_at_once_stops_within_its_bound(tmp_path, tiny_model_dir):
    config = write_config(tmp_path, tiny_model_dir)
    run_dir = tmp_path / "run"
    argv = {"master": ["tandem-master"], "buffer": ["tandem-buffer"],
            "trainer": ["tandem-trainer"], "explorer-0": ["tandem-explorer", "--name", "explorer-0"]}
    procs: dict[str, subprocess.Popen] = {}
    frozen: list[int] = []
    try:
        for name, (exe, *extra) in argv.items():
            procs[name] = subprocess.Popen(
                [str(BIN / exe), "--config", str(config), *extra],
                stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.err", "w"))
        deadline = time.monotonic() + BACKSTOP
        while not bench_stop.moment_reached(bench_stop.journal_records(run_dir),
                                            "TasksLeased", 2):
            ended = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            assert not ended and time.monotonic() < deadline, f"no lease of step 2; {ended}"
            time.sleep(0.02)
        for name in ("trainer", "explorer-0"):
            freeze(procs[name].pid)
            frozen.append(procs[name].pid)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for name in ("master", "buffer"):
            procs[name].wait(BACKSTOP)
        for pid in frozen:
            subprocess.run(["kill", "-CONT", str(pid)], check=True)
        frozen.clear()
        for name in ("trainer", "explorer-0"):
            procs[name].wait(BACKSTOP)  # before the fix this is where it failed
    finally:
        for pid in frozen:
            subprocess.run(["kill", "-CONT", str(pid)])
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert {n: p.returncode for n, p in procs.items()} == dict.fromkeys(procs, 0), {
        n: (tmp_path / f"{n}.err").read_text()[-2000:] for n in procs}

    # The trainer's exit checkpoint holds every step the master counted, written before any
    # call that could wait on a peer. The run may have gone past step 2's lease before the
    # freeze (on a quiet machine the poll saw 4 steps counted): the trainer is then idle at a
    # later step, or mid-step. A step it trained that the master never counted (its report
    # met the gone master) is never checkpointed: `--resume` trains it again.
    counted = sum(type(r).__name__ == "TrainerStepDone"
                  for r in bench_stop.journal_records(run_dir))
    trainer = events(run_dir, "trainer")
    trained = [e["step"] for e in trainer if e.get("event") == "train.step"]
    learner = trained[-1] + 1 if trained else 0
    assert counted >= 2 and learner in (counted, counted + 1), (counted, trained)
    signal_at = next(i for i, e in enumerate(trainer) if e.get("event") == "component.signal")
    after = trainer[signal_at:]
    saved = [e for e in after if e.get("event") == "checkpoint.saved"]
    calls = [e for e in after if e.get("event") == "rpc.stopping_call"
             and e["type"] != "heartbeat"]
    # its Goodbye to the master comes last, after every report (docs/protocol.md)
    assert [e["type"] for e in calls][-1:] == ["master.goodbye"], calls
    calls = calls[:-1]
    if learner == counted:
        assert saved and saved[-1]["step"] == counted, (counted, saved)
        assert [e["type"] for e in calls][-2:] == [
            "master.trainer.checkpointed", "buffer.checkpoint"], calls
        assert after.index(saved[-1]) < after.index(calls[-2]), after
    else:
        assert all(e["step"] <= counted for e in saved), (counted, saved)

    # each call after the stop was one attempt within the bound, and a gone peer was waited
    # for once: the stop's waiting is at most one bound per peer
    for name in ("trainer", "explorer-0"):
        stopping = [e for e in events(run_dir, name) if e.get("event") == "rpc.stopping_call"]
        assert all(e["attempts"] <= 1 for e in stopping), stopping
        for peer in {e["peer"] for e in stopping}:
            # calls to it already in flight (a heartbeat) share the first one's wait; none is
            # sent after it: each later call is refused at once (attempts 0)
            waited = [(at(e) - e["seconds"], at(e)) for e in stopping
                      if e["peer"] == peer and e["outcome"] == "no_answer"]
            assert all(start < waited[0][1] for start, _ in waited), (name, peer, stopping)
        # the bound each call ran under, as the client reports it: not this machine's clock
        assert all(e["bound"] == LIVENESS for e in stopping if e["attempts"]), stopping
