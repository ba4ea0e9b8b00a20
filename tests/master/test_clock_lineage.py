"""A resume never names a version it set aside (issue 32 item 5).

After SIGKILL of the whole run and `--resume`, the master replays its journal (versions up to
N published) before the trainer resumes from an older checkpoint S and moves v{S+1}..v{N} aside.
An explorer that registered in between was granted v{N} and exited with `weights version N not
found`. A restarted master now grants no barrier until the trainer shows which lineage goes on
(a version published, a step counted, or its first heartbeat, which comes once its resume is
done), and an explorer that registers holding nothing gets no stale barrier by snapshot.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem.common.messages.base import Heartbeat
from tandem.common.messages.master import (
    AwaitingTrainer,
    CompleteTasks,
    ExplorerStepDone,
    LeaseTasks,
    Register,
    TrainerResumed,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from tandem.common.errors import WaitTimeout
from tandem.common.sync import SyncPlan
from tandem.master.clock import RunClock
from tandem.master.journal import read_journal
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import Peer, make_config, master_client

N, S = 6, 2  # versions the lost lineage published; the step of the checkpoint it resumes from


def grants(decisions):
    return [(m.step, m.batch, m.version, m.wait) for t, m in decisions
            if t.startswith("barrier.")]


def run_to(clock: RunClock, versions: int) -> None:
    """Explorer a reports whatever it is granted; the trainer trains and publishes each step,
    until `versions` versions are out."""
    while clock.newest < versions:
        running = clock.explorers["a"].running
        if running is not None:
            clock.explorer_done("a", *running)
        elif clock.trainer_go > clock.trainer_done:
            clock.trainer_step_done(clock.trainer_done)
            clock.published(clock.trainer_done)
        else:
            raise AssertionError(f"stuck at {clock.counters()}")


# checkpoint sync (with nccl a lost lineage's versions stand: docs/design.md §5)
PLANS = {"synchronous": dict(offset=0), "one_step_off_policy": dict(offset=1),
         "fully_async": dict(offset=None, max_staleness=4)}


@pytest.mark.parametrize("preset", PLANS)
def test_after_a_master_restart_no_grant_names_a_version_the_resumed_trainer_set_aside(preset):
    clock = RunClock(SyncPlan(method="checkpoint", interval=1, **PLANS[preset]), total_steps=12)
    clock.join("a")
    run_to(clock, N)
    clock.await_trainer(True)  # the master restarted (journaled as AwaitingTrainer)
    out = clock.join("a")  # the explorer's restart registers before the trainer resumed
    out += clock.trainer_resumed(S)
    assert grants(out) == [] and clock.holds("a")[0] is None
    # the resumed trainer announces v{S} (it moved v{S+1}..v{N} aside): grants come from it
    out = clock.published(S, "checkpoint")
    lineage = {S}
    for step in range(S, 12):
        assert {v for _, _, v, _ in grants(out)} <= lineage, (step, grants(out), lineage)
        running = clock.explorers["a"].running
        if running is not None:
            out = clock.explorer_done("a", *running)
        if clock.trainer_go > clock.trainer_done:
            out += clock.trainer_step_done(clock.trainer_done)
            lineage.add(clock.trainer_done)
            out += clock.published(clock.trainer_done)
    assert clock.trainer_done >= 10  # the run goes on under the resumed lineage


def test_before_the_fix_the_explorer_was_granted_the_lost_lineages_newest():
    # what a master did without the hold: the explorer's restart took v{N} at once
    clock = RunClock(SyncPlan.preset("fully_async"), total_steps=12)
    clock.join("a")
    run_to(clock, N)
    assert [v for *_, v, _ in grants(clock.join("a"))] == [N]


def test_a_heartbeat_or_a_step_of_the_trainer_ends_the_wait():
    clock = RunClock(SyncPlan.preset("fully_async"), total_steps=12)
    clock.join("a")
    run_to(clock, N)
    clock.await_trainer(True)
    assert grants(clock.join("a")) == []
    assert [v for *_, v, _ in grants(clock.await_trainer(False))] == [N]  # its lineage goes on
    clock.await_trainer(True)
    clock.join("a")
    clock.trainer_step_done(clock.trainer_done)
    assert clock.holds("a")[0] is not None


async def test_a_restarted_master_grants_the_resumed_lineages_versions_only(
        tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=fully_async", "sync.max_staleness=1",
                         "master.total_steps=12", "explorers.0.batch_size=2", tasks=80)
    master = Master(config)
    await master.start()
    explorer = Peer(master, "explorer-0", "explorer", [barrier_topic("explorer-0")])
    trainer = master_client(master, "trainer")
    try:
        await explorer.start()
        await trainer.call(Register(name="trainer", role="trainer"))
        while master.clock.newest < N:  # the lost lineage: N steps trained and published
            barrier = await explorer.next("barrier")
            lease = await explorer.rpc.call(LeaseTasks(explorer="explorer-0", count=2,
                                                       step=barrier.step, batch=barrier.batch))
            await explorer.rpc.call(CompleteTasks(lease_id=lease.lease_id))
            await explorer.rpc.call(ExplorerStepDone(explorer="explorer-0", step=barrier.step,
                                                     batch=barrier.batch,
                                                     version=barrier.version))
            while master.clock.trainer_go > master.clock.trainer_done:
                done = master.clock.trainer_done
                await trainer.call(TrainerStepDone(step=done, version=done + 1))
                await trainer.call(WeightsPublished(version=done + 1, method="checkpoint",
                                                    path=f"weights/v{done + 1}"))
    finally:
        await explorer.close()
        await trainer.close()
        await master.close()  # the whole run is killed
    again = Master(config.model_copy(deep=True))
    await again.start()
    explorer = Peer(again, "explorer-0", "explorer", [barrier_topic("explorer-0")])
    trainer = master_client(again, "trainer")
    try:
        # before the trainer; like an explorer, it registers, then takes a snapshot
        registered = await explorer.rpc.call(Register(name="explorer-0", role="explorer"))
        await explorer.sub.start()
        assert registered.granted_step is None
        with pytest.raises(WaitTimeout):
            await explorer.next("barrier", timeout=0.5)  # no stale barrier, no grant
        await trainer.call(Register(name="trainer", role="trainer", meta={"step": S}))
        await trainer.call(TrainerResumed(step=S, lineage="new"))
        with pytest.raises(WaitTimeout):
            await explorer.next("barrier", timeout=0.5)  # its resume is not done yet
        await trainer.call(WeightsPublished(version=S, method="checkpoint",
                                            path=f"weights/v{S}"))
        lineage = S
        while again.clock.holds("explorer-0")[0] is None:  # the resumed trainer retrains S..
            assert again.clock.trainer_go > lineage, again.clock.counters()  # on the same groups
            await trainer.call(TrainerStepDone(step=lineage, version=lineage + 1))
            lineage += 1
            await trainer.call(WeightsPublished(version=lineage, method="checkpoint",
                                                path=f"weights/v{lineage}"))
        barrier = await explorer.next("barrier")
        assert barrier.version <= lineage  # published by the resumed lineage
        await trainer.call(Heartbeat(name="trainer"))
    finally:
        await explorer.close()
        await trainer.close()
        await again.close()
    kinds = [type(r).__name__ for r in read_journal(tmp_path / "run" / "master" / "journal.bin")]
    assert kinds.count("AwaitingTrainer") == 1  # set at the restart; the publication ended it
    # a third master replays both restarts' records to the same state
    third = Master(config.model_copy(deep=True))
    await third.start()
    try:
        assert third.clock.explorers["explorer-0"].running == again.clock.explorers[
            "explorer-0"].running
        assert third.clock.newest == lineage and third.clock.awaiting_trainer
    finally:
        await third.close()
    assert AwaitingTrainer(awaiting=False).awaiting is False
