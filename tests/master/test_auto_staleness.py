"""`sync.max_staleness: auto` in the master: the clock grants with the newest bound, every change
is journaled and traced, and a restarted master resumes the bound (docs/sync.md)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from backstop import BACKSTOP
from tandem.common.errors import ConfigError
from tandem.common.messages.master import StalenessSet, TrainerStepDone, WeightsPublished
from tandem.common.sync import SyncPlan
from tandem.common.trace import Tracer
from tandem.master.clock import RunClock
from tandem.master.journal import read_journal
from tandem.master.service import Master
from tandem.master.timeline import load_timeline

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import Peer, explorer_loop, make_config

AUTO = ("sync.preset=fully_async", "sync.max_staleness=auto", "sync.auto.min=1",
        "sync.auto.max=3", "sync.auto.patience=1", "sync.auto.target.below=0.02")


def barriers(decisions):
    return [(m.explorer, m.step, m.version) for t, m in decisions if t.startswith("barrier.")]


def test_clock_grants_with_the_newest_bound():
    clock = RunClock(SyncPlan.preset("fully_async", max_staleness=1), total_steps=6)
    assert barriers(clock.join("a")) == [("a", 0, 0)]
    assert barriers(clock.explorer_done("a", 0, 0, 0)) == [("a", 1, 0)]
    assert barriers(clock.explorer_done("a", 1, 1, 0)) == []  # step 2 needs version 1
    # widened to 2: step 2 may start on version 0, at once
    assert barriers(clock.set_staleness(2)) == [("a", 2, 0)]
    assert barriers(clock.explorer_done("a", 2, 2, 0)) == []  # step 3 needs version 1
    clock.set_staleness(1)  # narrowed: step 3 now needs version 2
    clock.trainer_step_done(0)
    assert barriers(clock.published(1)) == []
    clock.trainer_step_done(1)
    assert barriers(clock.published(2)) == [("a", 3, 2)]


async def trainer_with_metrics(master: Master, kl: list[float], trained: list):
    """A trainer whose step `t` reports `mismatch/kl = kl[t]`, tracing its steps."""
    peer = Peer(master, "trainer", "trainer", ["trainer", "stop"])
    tracer = Tracer(master.run_dir, "trainer")
    await peer.start()
    try:
        while True:
            msg = await peer.next("trainer")
            if msg.TYPE == "master.stop":
                return
            trained.append(msg.step)
            tracer.event("train", step=msg.step, version=msg.step)
            await peer.rpc.call(TrainerStepDone(step=msg.step, version=msg.step + 1,
                                                metrics={"mismatch/kl": kl[msg.step],
                                                         "loss/total": 0.1}))
            if msg.publish is not None:
                await peer.rpc.call(WeightsPublished(version=msg.publish, method="checkpoint",
                                                     path=f"weights/v{msg.publish}"))
    finally:
        tracer.close()
        await peer.close()


async def test_the_bound_moves_with_the_metric_is_journaled_traced_and_resumed(
        tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, *AUTO, "master.total_steps=8", "master.stop_grace=0",
                         "master.final_checkpoint_wait=0.1")
    kl = [0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    master = Master(config)
    await master.start()
    assert master.clock.plan.max_staleness == 1  # auto starts at min
    seen, trained = [], []
    try:
        await asyncio.wait_for(asyncio.gather(explorer_loop(master, "explorer-0", seen),
                                              trainer_with_metrics(master, kl, trained)), BACKSTOP)
    finally:
        await master.close()
    assert trained == list(range(8))
    assert all(version >= step - 3 for _, step, version, _, _ in seen)  # never past max
    run = tmp_path / "run"
    sets = [r for r in read_journal(run / "master" / "journal.bin")
            if isinstance(r, StalenessSet)]
    # patience 1: each step judges its own value; widen +1, narrow to half, within [1, 3]
    assert [(s.step, s.previous, s.bound, s.action) for s in sets] == [
        (0, 1, 2, "widen"), (1, 2, 3, "widen"), (3, 3, 1, "narrow"), (5, 1, 2, "widen"),
        (6, 2, 3, "widen")]
    assert sets[2].metric == "mismatch/kl" and sets[2].value == 0.5
    events = [json.loads(line) for line in (run / "trace" / "master.jsonl").open()]
    assert [(e["step"], e["attrs"]["bound"]) for e in events if e["kind"] == "staleness"] == [
        (s.step, s.bound) for s in sets]
    timeline = load_timeline(run)
    assert [b for _, b in timeline.staleness_bounds] == [1, 2, 3, 1, 2, 3]

    again = Master(config)  # the journal's bound, not the config's start
    await again.start()
    try:
        assert again.staleness.bound == 3 and again.clock.plan.max_staleness == 3
        assert again.status().counters.plan.max_staleness == 3
    finally:
        await again.close()


async def test_a_journal_of_auto_refuses_a_fixed_bound(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, *AUTO, "master.total_steps=4")
    master = Master(config)
    await master.start()
    master._commit(StalenessSet(step=0, bound=2, previous=1, action="widen",
                                metric="mismatch/kl", value=0.0))
    await master.close()
    fixed = make_config(tmp_path, "sync.preset=fully_async", "sync.max_staleness=1",
                        "master.total_steps=4")
    with pytest.raises(ConfigError, match="sync.max_staleness: auto"):
        await Master(fixed).start()
