"""RunClock: SyncPlan applied to live counters, several explorers, joins, deaths, restarts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerDraining,
    ExplorerStepDone,
    LeaseTasks,
    barrier_topic,
)
from tandem.common.sync import SyncPlan
from tandem.master.clock import RunClock, StepMismatch
from tandem.master.journal import read_journal
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import Peer, make_config


def barriers(decisions):
    return [(m.explorer, m.step, m.version, m.wait) for t, m in decisions
            if t.startswith("barrier.")]


def gos(decisions):
    return [(m.step, m.publish) for t, m in decisions if t == "trainer"]


def test_one_step_off_policy_sequence():
    clock = RunClock(SyncPlan.preset("one_step_off_policy"), total_steps=4)
    assert barriers(clock.join("a")) == [("a", 0, 0, False)]
    d = clock.explorer_done("a", 0, 0, 0)
    assert barriers(d) == [("a", 1, 0, False)] and gos(d) == [(0, 1)]
    d = clock.explorer_done("a", 1, 1, 0)
    assert barriers(d) == [] and gos(d) == []  # step 2 needs version 1; trainer is on step 0
    assert gos(clock.trainer_step_done(0)) == [(1, 2)]
    assert barriers(clock.published(1)) == [("a", 2, 1, True)]
    clock.explorer_done("a", 2, 2, 1)
    clock.trainer_step_done(1)
    assert barriers(clock.published(2)) == [("a", 3, 2, True)]
    clock.explorer_done("a", 3, 3, 2)
    clock.trainer_step_done(2)
    clock.published(3)  # nobody needs version 3 (the run has 4 steps), harmless
    d = clock.trainer_step_done(3)
    assert [t for t, _ in d] == ["stop"] and clock.stopped


def test_interval_4_trainer_publishes_only_sync_versions():
    clock = RunClock(SyncPlan(method="checkpoint", interval=4, offset=0), total_steps=8)
    clock.join("a")
    published = []
    for e in range(4):
        d = clock.explorer_done("a", e, e, 0)
        published += [m.publish for t, m in d if t == "trainer"]
        if e < 3:
            assert barriers(d) == [("a", e + 1, 0, False)]
    for t in range(3):
        published += [m.publish for _, m in clock.trainer_step_done(t) if _ == "trainer"]
    assert published == [None, None, None, 4]
    clock.trainer_step_done(3)
    assert barriers(clock.published(4)) == [("a", 4, 4, True)]


def test_two_explorers_synchronous_trainer_waits_for_both():
    clock = RunClock(SyncPlan.preset("synchronous", batches_per_step=2), total_steps=3)
    clock.join("a")
    clock.join("b")
    assert gos(clock.explorer_done("a", 0, 0, 0)) == []
    d = clock.explorer_done("b", 0, 1, 0)
    assert gos(d) == [(0, 1)]
    go = d[-1][1]
    assert go.batches == 2 and go.explorers == ["a", "b"] and go.in_use == [0]
    clock.trainer_step_done(0)
    assert sorted(barriers(clock.published(1))) == [("a", 1, 1, True), ("b", 1, 1, True)]


def test_dead_explorer_no_longer_holds_the_trainer_back():
    clock = RunClock(SyncPlan.preset("synchronous", batches_per_step=2), total_steps=3)
    clock.join("a")
    clock.join("b")
    clock.explorer_done("a", 0, 0, 0)
    d = clock.leave("b")  # b died while rolling out step 0
    assert gos(d) == [(0, 1)] and d[-1][1].batches == 1
    assert clock.batches_lost == 1


def test_late_joiner_is_a_member_from_the_oldest_unreleased_step():
    clock = RunClock(SyncPlan(method="checkpoint", interval=2, offset=0, batches_per_step=2),
                     total_steps=6)
    clock.join("a")
    clock.explorer_done("a", 0, 0, 0)  # a now runs step 1; the trainer was released on step 0
    d = clock.join("b")
    assert barriers(d) == [("b", 1, 0, False)]
    assert clock.explorers["b"].join_step == 1
    clock.explorer_done("a", 1, 1, 0)
    clock.trainer_step_done(0)
    assert clock.trainer_go == 1  # step 1 waits for b's batch too
    assert gos(clock.trainer_step_done(0)) == []  # a repeated report changes nothing
    assert gos(clock.explorer_done("b", 1, 2, 0)) == [(1, 2)]
    assert gos(clock.explorer_done("b", 1, 2, 0)) == []  # duplicate report
    clock.trainer_step_done(1)
    assert sorted(barriers(clock.published(2))) == [("a", 2, 2, True), ("b", 2, 2, True)]


def test_late_joiner_with_nccl_waits_for_the_next_broadcast():
    clock = RunClock(SyncPlan(method="nccl", interval=4, offset=0, batches_per_step=2),
                     total_steps=12)
    clock.join("a")
    for e in range(4):
        clock.explorer_done("a", e, e, 0)
        clock.trainer_step_done(e)
    clock.published(4)  # a is in the broadcast of version 4 and runs step 4
    assert barriers(clock.join("b")) == []
    assert clock.explorers["b"].join_step == 8
    # before anything was broadcast a joiner starts at once
    fresh = RunClock(SyncPlan(method="nccl", interval=4, offset=0, batches_per_step=2),
                     total_steps=12)
    fresh.join("a")
    fresh.explorer_done("a", 0, 0, 0)
    assert barriers(fresh.join("b")) == [("b", 1, 0, False)]


def test_restarted_explorer_redoes_its_granted_step_and_loads_weights():
    clock = RunClock(SyncPlan.preset("one_step_off_policy"), total_steps=6)
    clock.join("a")
    clock.explorer_done("a", 0, 0, 0)
    clock.explorer_done("a", 1, 1, 0)
    clock.trainer_step_done(0)
    clock.published(1)  # a runs step 2 with version 1
    d = clock.join("a")  # it crashed and came back before the master noticed
    b = d[0][1]
    assert (b.step, b.batch, b.version, b.wait) == (2, 2, 1, True)
    assert clock.batches_granted == 3


def test_explorer_rejoining_after_death_takes_over_open_steps():
    clock = RunClock(SyncPlan.preset("synchronous"), total_steps=5)
    clock.join("a")
    clock.explorer_done("a", 0, 0, 0)
    clock.trainer_step_done(0)
    clock.published(1)  # a runs step 1
    clock.leave("a")
    d = clock.join("a")
    assert barriers(d) == [("a", 1, 1, True)]


def test_explorer_reports_are_checked():
    clock = RunClock(SyncPlan.preset("synchronous"), total_steps=5)
    with pytest.raises(StepMismatch, match="not registered"):
        clock.explorer_done("ghost", 0, 0, 0)
    clock.join("a")
    with pytest.raises(StepMismatch, match="granted step 0 batch 0"):
        clock.explorer_done("a", 3, 3, 0)


def test_async_batches_staleness_and_trainer_cadence():
    plan = SyncPlan(method="checkpoint", interval=1, offset=None, max_staleness=1,
                    batches_per_step=2)
    clock = RunClock(plan, total_steps=3)
    assert barriers(clock.join("a")) == [("a", 0, 0, False)]
    assert barriers(clock.join("b")) == [("b", 0, 0, False)]
    d = clock.explorer_done("a", 0, 0, 0)
    assert barriers(d) == [("a", 1, 0, False)] and gos(d) == []
    d = clock.explorer_done("b", 0, 1, 0)
    assert gos(d) == [(0, 1)]
    assert barriers(d) == [("b", 1, 0, False)]  # batch 3 is step 1: still within staleness 1
    clock.explorer_done("b", 1, 3, 0)  # batch 4 would be step 2: needs version 1
    assert clock.explorers["b"].running is None
    clock.trainer_step_done(0)
    d = clock.published(1)
    assert barriers(d) == [("b", 2, 1, True)]
    # the run has 3 steps x 2 batches: once 6 are granted nobody gets more
    clock.explorer_done("a", 1, 2, 0)
    assert clock.batches_granted == 6
    assert clock.explorers["a"].running is not None


def test_async_lost_batch_is_granted_again():
    plan = SyncPlan.preset("fully_async", batches_per_step=1)
    clock = RunClock(plan, total_steps=2)
    clock.join("a")
    clock.join("b")  # batches 0 and 1 out: the whole run
    assert clock.batches_granted == 2
    clock.leave("b")
    clock.explorer_done("a", 0, 0, 0)
    assert clock.explorers["a"].running[:2] == (1, 2)  # b's step, new batch number


def test_a_batch_stored_before_its_explorer_left_counts_done_not_lost():
    # The explorer put its batch and completed its tasks, then died before ExplorerStepDone:
    # its tasks are not leased again, so the batch counts once as done (issue 14 item 3).
    clock = RunClock(SyncPlan.preset("synchronous"), total_steps=3)
    clock.join("a")
    d = clock.leave("a", stored=True, groups=4)
    assert clock.batches_done == 1 and clock.batches_lost == 0
    assert gos(d) == [(0, 1)] and clock.last_go.groups == 4
    assert barriers(d) == []  # nothing granted to the dead explorer
    # a batch not stored is lost, as before, and granted again to whoever joins
    clock.trainer_step_done(0)
    clock.published(1)
    clock.join("a")
    clock.leave("a")
    assert clock.batches_lost == 1
    assert barriers(clock.join("a")) == [("a", 1, 1, True)]


def test_a_restart_after_its_batch_was_stored_takes_the_next_step():
    plan = SyncPlan.preset("fully_async", batches_per_step=1)
    clock = RunClock(plan, total_steps=3)
    clock.join("a")
    d = clock.join("a", stored=True, groups=2)  # restarted before the master noticed
    assert clock.batches_done == 1 and clock.completed_groups == [2]
    assert [(m.step, m.batch) for t, m in d if t.startswith("barrier.")] == [(1, 1)]
    assert gos(d) == [(0, 1)]


def test_exhausted_taskset_ends_the_run_after_the_complete_steps():
    clock = RunClock(SyncPlan.preset("synchronous", batches_per_step=2), total_steps=10)
    clock.join("a")
    clock.join("b")
    clock.explorer_done("a", 0, 0, 0)
    clock.explorer_done("b", 0, 1, 0)
    clock.trainer_step_done(0)
    clock.published(1)  # both run step 1
    d = clock.tasks_exhausted("b")  # b's lease came back empty
    assert d == [] and not clock.stopped
    d = clock.explorer_done("a", 1, 2, 1)
    assert gos(d) == [(1, 2)]  # step 1 goes ahead with a's batch alone
    clock.trainer_step_done(1)
    d = clock.published(2)
    assert barriers(d) == [("a", 2, 2, True)]
    d = clock.tasks_exhausted("a")
    assert [t for t, _ in d] == ["stop"] and "exhausted after 2 of 10" in d[0][1].reason


def test_after_a_resume_under_nccl_the_lost_lineage_newest_version_goes_to_disk():
    """synchronous, the trainer killed with no checkpoint after 3 counted steps: it retrains
    0..2. Versions 1..3 went by in broadcasts and are never broadcast again, but a restarted
    explorer needs version 3 for its step 3: the retrained step 2 publishes it to disk, and a
    fresh explorer is granted it by checkpoint."""
    clock = RunClock(SyncPlan.preset("synchronous"), total_steps=6)
    clock.join("a")
    for step in range(3):
        clock.explorer_done("a", step, step, step)
        clock.trainer_step_done(step)
        clock.published(step + 1, "nccl")
    assert gos(clock.trainer_resumed(0)) == [(0, None)]
    assert clock.last_go.publish_by is None
    assert gos(clock.trainer_step_done(0)) == [(1, None)]
    d = clock.trainer_step_done(1)
    assert gos(d) == [(2, 3)] and clock.last_go.publish_by == "checkpoint"
    clock.published(3, "checkpoint")
    d = clock.join("a")  # the explorer restarted: it holds the base model
    assert [(m.step, m.version, m.method) for t, m in d if t.startswith("barrier.")] == [
        (3, 3, "checkpoint")]
    # one that came back before the file did is granted the broadcast, and takes the file
    # once it is there (WeightLoader polls weights/v3 while it waits)


# -- streaming across steps (asynchronous plans): a batch granted ahead while one drains ------


def ahead_plan(max_staleness=1, batches_per_step=1):
    return SyncPlan(method="checkpoint", interval=1, offset=None, max_staleness=max_staleness,
                    batches_per_step=batches_per_step)


def test_a_draining_explorer_is_granted_its_next_step_before_it_reports():
    clock = RunClock(ahead_plan(), total_steps=4)
    clock.join("a")
    assert barriers(clock.explorer_draining("a", 0, 0)) == [("a", 1, 0, False)]
    slot = clock.explorers["a"]
    assert slot.running[:2] == (0, 0) and slot.ahead[:2] == (1, 1)
    assert clock.explorer_draining("a", 0, 0) == []  # one batch ahead at most
    with pytest.raises(StepMismatch):
        clock.explorer_done("a", 1, 1, 0)  # reports come in grant order
    d = clock.explorer_done("a", 0, 0, 0)
    assert gos(d) == [(0, 1)] and barriers(d) == []  # the one ahead runs now: nothing new
    assert slot.running[:2] == (1, 1) and slot.ahead is None
    assert clock.explorer_draining("a", 0, 0) == []  # stale: batch 0 is reported
    # step 2 needs version 1 (staleness 1): the notice waits for it, the grant comes with it
    assert barriers(clock.explorer_draining("a", 1, 1)) == []
    clock.trainer_step_done(0)
    assert barriers(clock.published(1)) == [("a", 2, 1, True)]
    assert clock.explorers["a"].ahead[:2] == (2, 2)
    assert clock.trainer_go == 1  # version 0 is still in use by the running batch
    assert clock.last_go.in_use == [0]


def test_a_step_granted_ahead_loads_per_interval_counting_the_running_batch():
    plan = SyncPlan(method="checkpoint", interval=2, offset=None, max_staleness=4)
    clock = RunClock(plan, total_steps=6)
    clock.join("a")
    clock.published(1)
    # batch 0 rolls out with version 0: batch 1 is the second since the load, no load yet
    assert barriers(clock.explorer_draining("a", 0, 0)) == [("a", 1, 0, False)]
    clock.explorer_done("a", 0, 0, 0)
    # batch 1 makes two with version 0: batch 2, granted ahead of its report, loads
    assert barriers(clock.explorer_draining("a", 1, 1)) == [("a", 2, 1, True)]
    clock.explorer_done("a", 1, 1, 0)
    assert clock.explorers["a"].since_load == 0 and clock.explorers["a"].held == 1
    assert barriers(clock.explorer_draining("a", 2, 2)) == [("a", 3, 1, False)]


def test_no_batch_ahead_past_the_run_or_in_synchronous_plans():
    clock = RunClock(ahead_plan(batches_per_step=2), total_steps=1)
    clock.join("a")
    clock.join("b")  # batches 0 and 1: the whole run
    assert clock.explorer_draining("a", 0, 0) == [] and clock.explorers["a"].ahead is None
    # never a second batch of the running one's step (leases are per explorer and step): it
    # waits for another explorer to take that step's other batch
    clock = RunClock(ahead_plan(max_staleness=4, batches_per_step=2), total_steps=3)
    clock.join("a")
    assert clock.explorer_draining("a", 0, 0) == []
    assert barriers(clock.join("b")) == [("b", 0, 0, False)]
    # b took step 0's other batch: a's notice stands and both get a batch of step 1 ahead
    assert barriers(clock.explorer_draining("b", 0, 1)) == [("a", 1, 0, False),
                                                             ("b", 1, 0, False)]
    sync = RunClock(SyncPlan.preset("synchronous"), total_steps=3)
    sync.join("a")
    assert sync.explorer_draining("a", 0, 0) == [] and sync.explorers["a"].ahead is None


def test_an_explorer_dying_with_two_steps_in_flight_loses_both():
    clock = RunClock(ahead_plan(max_staleness=4, batches_per_step=2), total_steps=2)
    clock.join("a")
    clock.join("b")
    clock.explorer_draining("a", 0, 0)  # a holds batches 0 and 2
    assert clock.batches_granted == 3
    clock.leave("a")
    assert clock.batches_lost == 2 and clock.explorers["a"].ahead is None
    # b finishes batch 1 and takes both lost places: step 0's second batch, then step 1
    d = clock.explorer_done("b", 0, 1, 0)
    assert [(m.step, m.batch) for t, m in d if t.startswith("barrier.")] == [(0, 3)]
    assert [(m.step, m.batch) for t, m in clock.explorer_draining("b", 0, 3)
            if t.startswith("barrier.")] == [(1, 4)]
    assert gos(clock.explorer_done("b", 0, 3, 0)) == [(0, 1)]
    d = clock.explorer_done("b", 1, 4, 0)
    assert gos(d) == [] and barriers(d) == [("b", 1, 0, False)]  # step 1's second batch
    assert clock.batches_done == 3 and clock.batches_granted == 6


def test_a_restart_redoes_the_running_step_and_loses_the_one_ahead():
    clock = RunClock(ahead_plan(max_staleness=4), total_steps=4)
    clock.join("a")
    clock.explorer_draining("a", 0, 0)
    d = clock.join("a")  # restarted before its liveness ran out
    assert [(m.step, m.batch) for t, m in d if t.startswith("barrier.")] == [(0, 0)]
    assert clock.batches_lost == 1
    # then the next batch takes the lost one's step, under a new number
    assert [(m.step, m.batch) for t, m in clock.explorer_draining("a", 0, 0)
            if t.startswith("barrier.")] == [(1, 2)]


def test_a_taskset_dry_on_the_step_ahead_lets_the_running_one_finish():
    clock = RunClock(ahead_plan(max_staleness=4), total_steps=4)
    clock.join("a")
    clock.explorer_draining("a", 0, 0)
    assert clock.tasks_exhausted("a") == [] and not clock.stopped  # its lease for step 1
    assert clock.explorers["a"].running[:2] == (0, 0) and clock.batches_lost == 1
    d = clock.explorer_done("a", 0, 0, 0)
    assert gos(d) == [(0, 1)] and not clock.stopped
    d = clock.trainer_step_done(0)
    assert [t for t, _ in d] == ["stop"] and "exhausted after 1 of 4" in d[0][1].reason


def test_replaying_the_inputs_with_batches_ahead_gives_the_same_decisions():
    inputs = [("join", "a"), ("join", "b"), ("explorer_draining", "a", 0, 0),
              ("explorer_draining", "b", 0, 1), ("explorer_done", "a", 0, 0, 0),
              ("leave", "b"), ("join", "b"), ("explorer_draining", "a", 1, 2),
              ("explorer_done", "a", 1, 2, 0), ("explorer_draining", "a", 1, 5),
              ("trainer_step_done", 0), ("published", 1)]

    def run():
        clock = RunClock(ahead_plan(max_staleness=1, batches_per_step=2), total_steps=3)
        out = [[(t, m.model_dump()) for t, m in getattr(clock, name)(*args)]
               for name, *args in inputs]
        return out, {n: (s.running, s.ahead, s.held, s.since_load)
                     for n, s in clock.explorers.items()}, clock.counters()

    first = run()
    assert first == run()
    # the last input grants a's step ahead, with the version just published
    assert first[1]["a"][:2] == ((1, 5, 0), (2, 6, 1))
    assert first[0][-1][0][1]["batch"] == 6 and first[0][-1][0][1]["wait"] is True


async def test_a_grant_ahead_is_journaled_and_a_restarted_master_replays_it(tmp_path,
                                                                           zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=4")
    master = Master(config)
    await master.start()
    peer = Peer(master, "explorer-0", "explorer", [barrier_topic("explorer-0")])
    try:
        await peer.start()
        first = await peer.next("barrier")
        lease = await peer.rpc.call(LeaseTasks(explorer="explorer-0", count=4, step=0))
        await peer.rpc.call(ExplorerDraining(explorer="explorer-0", step=0, batch=0))
        ahead = await peer.next("barrier")  # granted before step 0 is reported
        assert (first.step, first.batch, ahead.step, ahead.batch) == (0, 0, 1, 1)
        # a second lease, for the step ahead, while the first is open: other tasks
        second = await peer.rpc.call(LeaseTasks(explorer="explorer-0", count=4, step=1))
        assert not {t.id for t in lease.tasks} & {t.id for t in second.tasks}
    finally:
        await peer.close()
        await master.close()
    kinds = [type(m).__name__ for m in read_journal(tmp_path / "run" / "master" / "journal.bin")]
    assert kinds[-3:] == ["TasksLeased", "ExplorerDraining", "TasksLeased"]
    again = Master(config.model_copy(deep=True))
    await again.start()
    peer = Peer(again, "explorer-0", "explorer", [barrier_topic("explorer-0")])
    try:
        slot = again.clock.explorers["explorer-0"]
        assert slot.running == (0, 0, 0) and slot.ahead == (1, 1, 0)
        await peer.sub.start()  # the snapshot is the newest barrier: the one ahead
        assert (await peer.next("barrier")).batch == 1
        await peer.rpc.call(CompleteTasks(lease_id=lease.lease_id))
        await peer.rpc.call(ExplorerStepDone(explorer="explorer-0", step=0, batch=0,
                                             version=0))
        assert slot.running == (1, 1, 0) and slot.ahead is None
    finally:
        await peer.close()
        await again.close()


@pytest.mark.parametrize("sleeps_last", [True, False])
def test_colocated_explorer_sleeps_after_each_step(sleeps_last):
    # placement.colocate: the trainer trains each step on the explorer's devices; after the
    # last one too, unless the explorer evaluates at the end (nothing could wake it for that)
    clock = RunClock(SyncPlan(method="checkpoint", interval=1, offset=0), total_steps=3,
                     colocated="a", colocated_sleeps_last=sleeps_last)
    sleeps = [m.sleep_after for _, m in clock.join("a") if hasattr(m, "sleep_after")]
    for step in range(3):
        clock.explorer_done("a", step, step, step)
        d = clock.trainer_step_done(step)
        d += clock.published(step + 1) if step < 2 else []
        sleeps += [m.sleep_after for t, m in d if t.startswith("barrier.")]
    assert sleeps == [True, True, sleeps_last]
    other = RunClock(SyncPlan(method="checkpoint", interval=1, offset=0), total_steps=3)
    assert [m.sleep_after for _, m in other.join("a")] == [False]
