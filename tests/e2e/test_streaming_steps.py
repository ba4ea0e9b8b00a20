"""Streaming across step boundaries (`explorers[].lease_ahead`, asynchronous plans), through
real processes: the explorer leases and rolls out its next step while this one drains.

The run is also the `fully_async` preset's end-to-end check (tests/e2e/test_presets.py runs
the other presets): its trace obeys the preset's SyncPlan and the trainer publishes by the
preset's method. Its staleness bound is `auto` (docs/sync.md), with a target no step misses:
the master widens it once per step to its max, and journals and traces each change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from processes import freeze, wait_for
from tandem.common.config import RunConfig
from tandem.common.messages import ExplorerStepDone, StalenessSet, TasksLeased
from tandem.common.sync import SyncPlan
from tandem.common.trace import read_trace
from tandem.master.journal import JournalError, read_journal
from tandem.master.quickstart import reversal_tasks, write_jsonl
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
STEPS = 4
TANDEM = str(Path(sys.executable).parent / "tandem")


def journal(run_dir: Path) -> list:
    try:
        return read_journal(run_dir / "master" / "journal.bin")
    except (JournalError, OSError):
        return []


def child_pid(up_pid: int, name: str) -> int | None:
    """The pid of `tandem up`'s child `tandem-<name>`, once it started."""
    try:
        children = Path(f"/proc/{up_pid}/task/{up_pid}/children").read_text().split()
    except OSError:
        return None
    for pid in map(int, children):
        try:
            if f"tandem-{name}" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                    errors="replace"):
                return pid
        except OSError:
            continue
    return None


def samples_scored(run_dir: Path) -> int:
    """Samples the explorer's reward functions scored so far, from its live /metrics."""
    try:
        url = (run_dir / "metrics" / "explorer-0.url").read_text().strip()
        with urllib.request.urlopen(url, timeout=BACKSTOP) as reply:
            text = reply.read().decode()
    except OSError:
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tandem_explorer_reward{") and 'stat="evaluated"' in line))




def test_the_next_step_rolls_out_while_this_one_drains(tmp_path, tiny_model_dir):
    """The overlap is made, not hoped for (a tiny model rolls a step out in tens of
    milliseconds, about the time the next step's lease takes): the buffer is frozen from the
    start, so no put is acked and no step can be reported. Step 1 must still be leased and
    rolled out, a sample of it scored, while step 0 waits for its puts: without lease_ahead a
    step's tasks are leased only after the step before is reported, which the frozen buffer
    holds back for as long as it stays frozen."""
    train, _ = reversal_tasks(0)
    taskset = write_jsonl(train[:64], tmp_path / "train.jsonl")
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": "ahead", "run_dir": str(run_dir), "model": {"path": str(tiny_model_dir)},
        # staleness 4 or more over 4 steps: the master never holds a grant back for the
        # trainer; auto widens it from 4 after each step's report while mismatch/kl < 5e8
        "sync": {"preset": "fully_async", "timeout": BACKSTOP, "max_staleness": "auto",
                 "auto": {"min": 4, "max": 6, "patience": 1, "target": {"below": 1.0e9}}},
        "master": {"total_steps": STEPS, "taskset": {"path": str(taskset), "epochs": 10}},
        # one task per engine batch: a step is six batches one after the other
        "explorers": [{"name": "explorer-0", "batch_size": 6, "repeat_times": 2,
                       "engine": {"max_batch": 2},
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 12}}],
        "trainer": {"groups_per_step": 6, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        # a buffer held frozen is not a dead one: its clients wait for it
        "transport": {"liveness": BACKSTOP, "rpc_timeout": BACKSTOP},
        "logging": {"level": "warning"},
        "up": {"run_timeout": BACKSTOP, "timeline": False},
    }))
    proc = subprocess.Popen([TANDEM, "up", str(config), "--plain"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    buffer = None
    try:
        buffer = wait_for(lambda: child_pid(proc.pid, "buffer"), BACKSTOP, "buffer process")
        freeze(buffer)
        # step 0 is 12 samples: one more scored is step 1 generating while step 0 drains
        wait_for(lambda: samples_scored(run_dir) > 12, BACKSTOP, "sample of step 1 scored")
        records = journal(run_dir)
        os.kill(buffer, signal.SIGCONT)
        buffer = None
        out, _ = proc.communicate(timeout=BACKSTOP)  # only against a hang
    finally:
        if buffer is not None:
            os.kill(buffer, signal.SIGCONT)
        if proc.poll() is None:  # a failed wait: `tandem up` stops what it started
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=BACKSTOP)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    # while the buffer was frozen: step 1 leased (and rolling out), step 0 unreported
    assert any(isinstance(r, TasksLeased) and r.step == 1 for r in records)
    assert not any(isinstance(r, ExplorerStepDone) for r in records)
    spans = read_trace(run_dir)
    rollouts = sorted((s for s in spans if s["kind"] == "rollout"), key=lambda s: s["start"])
    # every step rolled out once, in order, each with at most the plan's staleness
    plan = SyncPlan.from_config(RunConfig.model_validate(
        yaml.safe_load(config.read_text())).sync, batches_per_step=1)
    assert plan.asynchronous and plan.max_staleness == 4
    assert [s["step"] for s in rollouts] == list(range(STEPS))
    assert all(s["step"] - s["version"] <= plan.max_staleness for s in rollouts), rollouts
    trains = [s for s in spans if s["kind"] == "train"]
    assert sorted(s["step"] for s in trains) == list(range(STEPS))
    # step 1's rollout began before step 0's ended (its puts waited for the buffer)
    assert rollouts[1]["start"] < rollouts[0]["end"], rollouts[:2]
    # the trainer published by the preset's method (the timeline drawing the other presets'
    # runs check: `tandem up` draws it in the background, after it exits)
    syncs = {(s["component"], (s.get("attrs") or {}).get("method")) for s in spans
             if s["kind"] == "sync"}
    assert ("trainer", "checkpoint") in syncs, syncs
    # max_staleness: auto: steps 0 and 1 widen the bound to its max, journaled and traced
    sets = [r for r in journal(run_dir) if isinstance(r, StalenessSet)]
    assert [(r.step, r.previous, r.bound, r.metric) for r in sets] == [
        (0, 4, 5, "mismatch/kl"), (1, 5, 6, "mismatch/kl")], sets
    assert sorted((s["step"], s["attrs"]["bound"]) for s in spans
                  if s["kind"] == "staleness") == [(0, 5), (1, 6)]
