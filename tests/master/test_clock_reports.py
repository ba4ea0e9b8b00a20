"""A step is reported once, whatever restarts (issue 32 item 2).

A restarted explorer whose next step was held back (the trainer, the buffer or the master
paused) took the snapshot of its last barrier, a batch it had already reported, rolled it out
again with new tasks, and the master accepted the second report: those groups were acked and
stored and never trained. The clock now remembers every batch it counted, tells a registering
explorer what it holds, answers a repeated report without counting it (also after the explorer
was declared dead and its slot made anew), and the master refuses new tasks for such a batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem.common.errors import RequestFailed
from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerStepDone,
    LeaseTasks,
    barrier_topic,
)
from tandem.common.sync import SyncPlan
from tandem.master.clock import RunClock
from tandem.master.journal import read_journal
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import Peer, make_config


def held_back() -> RunClock:
    """fully_async, staleness 1: explorer a reported batches 0 and 1 (steps 0 and 1); step 2
    needs version 1, and the trainer is paused before it publishes it."""
    plan = SyncPlan(method="checkpoint", interval=1, offset=None, max_staleness=1)
    clock = RunClock(plan, total_steps=4)
    clock.join("a")
    clock.explorer_done("a", 0, 0, 0, groups=2)
    clock.explorer_done("a", 1, 1, 0, groups=2)
    assert clock.explorers["a"].running is None  # held back
    return clock


def state(clock: RunClock):
    return (clock.batches_granted, clock.batches_done, clock.batches_lost,
            list(clock.completed_groups), clock.trainer_go, dict(clock.reported))


def test_a_restarted_explorer_learns_it_holds_nothing_and_its_repeat_is_not_counted():
    clock = held_back()
    before = state(clock)
    assert clock.join("a") == []  # it restarted faster than its liveness: nothing to redo
    assert clock.holds("a") == (None, 1)
    assert clock.explorer_done("a", 1, 1, 0, groups=2) == []
    assert state(clock) == before
    # the step held back comes with a new batch number, past the reported one
    clock.trainer_step_done(0)
    granted = [m for t, m in clock.published(1) if t == barrier_topic("a")]
    assert [(m.step, m.batch) for m in granted] == [(2, 2)]
    assert clock.holds("a") == ((2, 2, 1), 1)


def test_a_repeat_after_the_explorer_was_declared_dead_is_answered_not_refused():
    # the master paused: it declared the explorer dead when it woke, the explorer's restart
    # registered anew, and the re-rolled step was refused `unexpected_step` (exit 1)
    clock = held_back()
    clock.leave("a")
    clock.join("a")
    before = state(clock)
    assert clock.holds("a") == (None, 1)
    assert clock.explorer_done("a", 1, 1, 0, groups=2) == []
    assert state(clock) == before


def test_a_batch_counted_through_a_stored_restart_is_reported_too():
    plan = SyncPlan.preset("fully_async", batches_per_step=1)
    clock = RunClock(plan, total_steps=3)
    clock.join("a")
    clock.join("a", stored=True, groups=2)  # its report was lost with it, the batch stored
    assert clock.holds("a")[1] == 0 and clock.is_reported("a", 0, 0)
    assert clock.explorer_done("a", 0, 0, 0) == [] and clock.batches_done == 1


def test_only_the_same_explorer_step_and_batch_is_a_repeat():
    clock = held_back()
    assert clock.is_reported("a", 1, 1)
    assert not clock.is_reported("b", 1, 1)
    assert not clock.is_reported("a", 0, 1)
    assert not clock.is_reported("a", 1, None)  # no batch named: the slot's last one decides


def test_replaying_the_inputs_with_restarts_and_repeats_gives_the_same_state():
    inputs = [("join", "a"), ("explorer_done", "a", 0, 0, 0), ("explorer_done", "a", 1, 1, 0),
              ("join", "a"), ("explorer_done", "a", 1, 1, 0), ("leave", "a"), ("join", "a"),
              ("explorer_done", "a", 1, 1, 0), ("explorer_done", "a", 0, 0, 0),
              ("trainer_step_done", 0), ("published", 1), ("explorer_done", "a", 2, 2, 1)]

    def run():
        plan = SyncPlan(method="checkpoint", interval=1, offset=None, max_staleness=1)
        clock = RunClock(plan, total_steps=4)
        out = [[(t, m.model_dump()) for t, m in getattr(clock, name)(*args)]
               for name, *args in inputs]
        return out, state(clock), clock.holds("a"), clock.counters()

    first = run()
    assert first == run()
    assert first[1][1] == 3 and first[2] == (None, 2)  # step 3 waits for version 2


async def test_the_master_refuses_new_tasks_for_a_reported_batch_and_answers_its_repeat(
        tmp_path, zmq_sockets_closed):
    # synchronous: step 1 waits for the trainer's version 1, which never comes here
    config = make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=3")
    master = Master(config)
    await master.start()
    peer = Peer(master, "explorer-0", "explorer", [barrier_topic("explorer-0")])
    again = Peer(master, "explorer-0", "explorer", [barrier_topic("explorer-0")])
    journal = tmp_path / "run" / "master" / "journal.bin"
    try:
        registered = await peer.start()
        assert registered.granted_step == 0 and registered.reported_batch is None
        barrier = await peer.next("barrier")
        lease = await peer.rpc.call(LeaseTasks(explorer="explorer-0", count=4, step=0,
                                               batch=barrier.batch))
        await peer.rpc.call(CompleteTasks(lease_id=lease.lease_id))
        done = ExplorerStepDone(explorer="explorer-0", step=0, batch=barrier.batch, version=0)
        await peer.rpc.call(done)
        counters = master.clock.counters()
        # the restart: registers, and its subscription's snapshot is the reported barrier
        registered = await again.start()
        assert (registered.granted_step, registered.reported_batch) == (None, barrier.batch)
        assert (await again.next("barrier")).batch == barrier.batch
        records = len(read_journal(journal))
        with pytest.raises(RequestFailed) as refused:
            await again.rpc.call(LeaseTasks(explorer="explorer-0", count=4, step=0,
                                            batch=barrier.batch))
        assert refused.value.code == "step_reported"
        assert "explorer-0 already reported step 0 batch 0" in refused.value.message
        await again.rpc.call(done)  # answered, not counted, not journaled
        assert master.clock.counters() == counters
        assert master.dispatcher.counters()["tasks_dispatched"] == 4
    finally:
        await peer.close()
        await again.close()
        await master.close()
    assert len(read_journal(journal)) == records
