"""A SIGTERM stop of `tandem up` ends within `up.stop_timeout` plus the trainer's exit
checkpoint, in every preset, whether it lands mid-rollout, mid-train or mid-broadcast: nothing
waits on a peer that is stopping too (issue 32 item 1: a synchronous stop waited out
`sync.timeout`, 120 s).

The moment is chosen from the master's journal (its newest record: TasksLeased, an explorer rolls
out; ExplorerStepDone, the trainer trains; WeightsPublished, the trainer sends the version).
Mid-broadcast in the nccl presets, the explorer is held (SIGSTOP) from its report of the step
before, and the SIGTERM comes once the journal has a version announced that the trainer's log
has not seen broadcast: that broadcast cannot end before the SIGTERM. The explorer goes on once
the supervisor has signalled both. The duration is the run's own: the supervisor's `stop` span
(signal to last exit) and the trainer's `checkpoint` span, from the run's trace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


import bench_stop
import resume_check
from processes import freeze, wait_for
from tandem.common.trace import JsonlTail, read_trace
from backstop import BACKSTOP

AT_STEP = 2
# far below sync.timeout (BACKSTOP): a stop that waits for it has its waiting component
# SIGKILLed at STOP_TIMEOUT, and `killed` names it; a healthy stop ends far sooner on any machine
STOP_TIMEOUT = BACKSTOP / 3
# Every preset and every moment, not every pair (tools/bench_stop.py times all twelve): the
# synchronous preset, whose stop waited out sync.timeout, at each moment; one step off policy
# (nccl too) mid-broadcast; the asynchronous ones, which publish by checkpoint, mid-train and
# mid-rollout (two explorers).
CASES = [("synchronous", "rollout"), ("synchronous", "train"), ("synchronous", "broadcast"),
         ("one_step_off_policy", "broadcast"), ("fully_async", "train"),
         ("multi_explorer_async", "rollout")]


def write_config(tmp_path: Path, model_dir: Path, preset: str) -> Path:
    path = bench_stop.write_config(tmp_path, model_dir, preset, sync_timeout=BACKSTOP)
    config = yaml.safe_load(path.read_text())
    config["up"].update(stop_timeout=STOP_TIMEOUT, run_timeout=BACKSTOP)
    config["logging"]["level"] = "info"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path




def reach(proc: subprocess.Popen, run_dir: Path, record: str, step: int) -> None:
    """Return once the journal's newest record is `record` at `step` or later."""
    wait_for(lambda: proc.poll() is not None or bench_stop.moment_reached(
        bench_stop.journal_records(run_dir), record, step), BACKSTOP, f"{record} at step {step}")
    assert proc.poll() is None, f"tandem up ended (code {proc.returncode}) before the moment"


def explorer_pid(up: subprocess.Popen) -> int:
    for pid in resume_check.children_of(up.pid):
        if b"tandem-explorer" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no explorer below tandem up")


def go_on(pid: int) -> None:
    """SIGCONT `pid`, unless it is gone (a supervisor that SIGKILLed it)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def broadcast_pending(run_dir: Path) -> bool:
    """Whether a version the journal says was announced by broadcast has not reached every
    member yet (the trainer logs `weights.broadcast` once it has)."""
    announced = {r.version for r in bench_stop.journal_records(run_dir)
                 if type(r).__name__ == "WeightsPublished" and r.method == "nccl"}
    sent = {e.get("version") for e in JsonlTail().new_objects(run_dir / "logs" / "trainer.jsonl")
            if e.get("event") == "weights.broadcast"}
    return bool(announced - sent)


def signalled(log: Path) -> bool:
    return any(e.get("event") == "component.signal" for e in JsonlTail().new_objects(log))


def test_the_supervisor_stops_the_trainer_with_the_explorers(tmp_path):
    """The explorer here leaves only once the trainer has its SIGTERM (a trainer that waits for
    explorers that are leaving, and explorers that wait for it, in one): a stop in stages
    explorers-then-trainer deadlocks until `up.stop_timeout` and SIGKILLs the explorer."""
    from tandem.common.config import RunConfig
    from tandem.master.up import Child, Supervisor

    released = tmp_path / "trainer-signalled"
    sup = Supervisor(RunConfig.model_validate(
        {"run_dir": str(tmp_path), "up": {"stop_timeout": STOP_TIMEOUT, "trainer_stop_timeout": STOP_TIMEOUT},
         "logging": {"level": "warning"}}), live=False)
    # each signs in (NAME.up) once its handler is installed, and on SIGTERM exits 0 when its
    # condition holds: the explorer once the trainer was signalled, the others at once
    script = ("import os, signal, sys, time\n"
              "stopping = []\n"
              "signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))\n"
              "open(sys.argv[1] + '.up', 'w').close()\n"
              "while not (stopping and {}):\n"
              "    time.sleep(0.05)")
    explorer = script.format("os.path.exists(sys.argv[2])")
    trainer = script.format("open(sys.argv[2], 'w').close() is None")
    serving = [sys.executable, "-c", script.format("True")]
    sup.children = [Child(name, role, argv, tmp_path / f"{name}.out") for name, role, argv in [
        ("master", "master", [*serving, str(tmp_path / "master")]),
        ("buffer", "buffer", [*serving, str(tmp_path / "buffer")]),
        ("trainer", "trainer", [sys.executable, "-c", trainer, str(tmp_path / "trainer"),
                                str(released)]),
        ("explorer-0", "explorer", [sys.executable, "-c", explorer,
                                    str(tmp_path / "explorer-0"), str(released)])]]
    for child in sup.children:
        child.start()
    for name in (child.name for child in sup.children):  # each has its handler installed
        wait_for((tmp_path / f"{name}.up").exists, BACKSTOP, f"{name} to start")
    sup.request_stop("SIGTERM")
    sup._stop_all()
    stop, = [s for s in read_trace(tmp_path) if s["kind"] == "stop"]
    assert stop["attrs"]["killed"] == [], stop
    assert {n: e["code"] for n, e in stop["attrs"]["exits"].items()} == {
        "explorer-0": 0, "trainer": 0, "buffer": 0, "master": 0}, stop


@pytest.mark.slow
@pytest.mark.parametrize("preset,moment", CASES)
def test_sigterm_stop_is_bounded(tmp_path, tiny_model_dir, preset, moment):
    config = write_config(tmp_path, tiny_model_dir, preset)
    run_dir = tmp_path / "run"
    logs = run_dir / "logs"
    proc = subprocess.Popen([bench_stop.TANDEM, "up", str(config), "--plain"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    nccl = preset in ("synchronous", "one_step_off_policy")
    held = None
    try:
        if moment == "broadcast" and nccl:
            # held from its report of step N-1 on: the trainer announces a version (N in
            # synchronous, N-1 or N one step off) and broadcasts it to an explorer that cannot
            # take it
            reach(proc, run_dir, "ExplorerStepDone", AT_STEP - 1)
            held = explorer_pid(proc)
            freeze(held)
            wait_for(lambda: proc.poll() is not None or broadcast_pending(run_dir), BACKSTOP,
                     "a broadcast the held explorer cannot take")
        else:
            reach(proc, run_dir, bench_stop.MOMENTS[moment], AT_STEP)
        proc.send_signal(signal.SIGTERM)
        if held is not None:
            # the supervisor signals the explorers, then the trainer: both have theirs now
            wait_for(lambda: signalled(logs / "trainer.jsonl"), BACKSTOP, "the trainer's SIGTERM")
            go_on(held)
            held = None
        out, _ = proc.communicate(timeout=BACKSTOP)
    finally:
        if held is not None:
            go_on(held)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out[-3000:]
    spans = read_trace(run_dir)
    stop, = [s for s in spans if s["component"] == "up" and s["kind"] == "stop"]
    attrs = stop["attrs"]
    assert attrs["reason"] == "SIGTERM"
    assert attrs["killed"] == [], attrs
    assert {name: e["code"] for name, e in attrs["exits"].items()} == {
        name: 0 for name in attrs["exits"]}, attrs["exits"]
    checkpoint = [s for s in spans if s["kind"] == "checkpoint"
                  and s["start"] >= stop["start"]]
    writing = sum(s["end"] - s["start"] for s in checkpoint)
    seconds = stop["end"] - stop["start"]
    assert seconds <= STOP_TIMEOUT + writing, (
        f"{preset} stopped {moment}: {seconds:.1f} s from SIGTERM to the last exit, bound "
        f"{STOP_TIMEOUT:g} s + {writing:.1f} s of checkpoint; exits {attrs['exits']}")
    assert checkpoint, "no exit checkpoint was written"
