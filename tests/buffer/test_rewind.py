"""Acks record the consuming step; a rewind makes what later steps consumed sampleable again;
leases of one holder are released at once; rows a rewind may need outlive the pruner."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from backstop import BACKSTOP
from processes import until
from buffer_helpers import Running, config_for, make_group
from tandem.buffer import RewindTooFar, SqliteStore
from tandem.common.errors import RequestFailed
from tandem.common.messages import (
    AckLease, CheckpointSaved, GetBufferStats, PutExperiences, ReleaseLeases, RewindTo,
    SampleGroups,
)


def run(coro):
    return asyncio.run(coro)


async def fill(store, tasks: str, size: int = 2) -> None:
    for task in tasks:
        await store.put(make_group(task, size), [size] * size)


async def train(store, steps: range, holder: str | None = "trainer") -> list[list[str]]:
    """One group per step, acked with the step; the groups each step consumed."""
    consumed = []
    for step in steps:
        lease = await store.sample(1, holder=holder)
        await store.ack(lease.lease_id, step)
        consumed.append(lease.group_ids)
    return consumed


def rows(path, group_id: str) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT count(*) FROM experiences WHERE group_id = ?",
                          (group_id,)).fetchone()[0]
    finally:
        db.close()


def eventually(check) -> bool:
    """Whether `check()` comes true (polled; BACKSTOP only bounds a hang)."""
    deadline = time.monotonic() + BACKSTOP
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_rewind_trains_what_came_after_the_checkpoint_once_more(open_store):
    store = open_store()

    async def go():
        await fill(store, "abcdef")
        first = await train(store, range(6))
        assert first == [["a@v0"], ["b@v0"], ["c@v0"], ["d@v0"], ["e@v0"], ["f@v0"]]
        outcome = await store.rewind(3)  # the checkpoint holds steps 0, 1, 2
        assert (outcome.groups, outcome.uses, outcome.leases_released) == (3, 3, 0)
        stats = await store.stats()
        assert stats.groups_ready == 3 and stats.by_state["consumed"] == 6
        again = await store.rewind(3)  # idempotent
        assert (again.groups, again.uses, again.leases_released) == (0, 0, 0)
        second = await train(store, range(3, 6))
        with pytest.raises(Exception, match="not enough"):
            await store.sample(1)
        return second, await store.stats()

    second, stats = run(go())
    assert second == [["d@v0"], ["e@v0"], ["f@v0"]]  # each trained once into the new lineage
    assert stats.by_state["consumed"] == 12 and stats.groups_ready == 0


def test_rewind_releases_every_lease_and_is_durable(open_store, tmp_path, clock):
    store = open_store()

    async def first():
        await fill(store, "abc")
        await train(store, range(2))
        return await store.sample(1, holder="trainer")  # the dead incarnation's lease

    lease = run(first())
    outcome = run(store.rewind(1))
    assert (outcome.groups, outcome.leases_released) == (1, 1)
    store.close_sync()
    store = open_store()

    async def second():
        stats = await store.stats()
        assert stats.leases == 0 and stats.groups_ready == 2
        with pytest.raises(Exception, match="unknown"):
            await store.ack(lease.lease_id, 2)
        return await store.sample(2)

    assert run(second()).group_ids == ["b@v0", "c@v0"]


def test_acks_without_a_step_are_never_rewound(open_store):
    store = open_store()

    async def go():
        await fill(store, "ab")
        lease = await store.sample(2)
        await store.ack(lease.lease_id)
        assert (await store.rewind(0)).groups == 0
        return await store.stats()

    assert run(go()).by_state["consumed"] == 4


def test_rewind_undoes_single_uses_under_replay(open_store):
    store = open_store(reuse=2)

    async def go():
        await fill(store, "a")
        await train(store, range(2))  # used at step 0 and 1: consumed
        assert (await store.stats()).by_state["consumed"] == 2
        outcome = await store.rewind(1)
        assert (outcome.groups, outcome.uses) == (1, 1)
        lease = await store.sample(1)
        await store.ack(lease.lease_id, 1)
        with pytest.raises(Exception, match="not enough"):
            await store.sample(1)  # used twice again, no more
        outcome = await store.rewind(0)
        assert (outcome.groups, outcome.uses) == (1, 2)

    run(go())


def test_release_holder_returns_only_that_holders_leases(open_store):
    store = open_store(lease_seconds=3600)

    async def go():
        await fill(store, "abc")
        mine = await store.sample(1, holder="trainer")
        await store.sample(1, holder="trainer")
        theirs = await store.sample(1, holder="other")
        assert mine.holder == "trainer"
        assert await store.release_holder("trainer") == 2
        assert await store.release_holder("trainer") == 0
        stats = await store.stats()
        assert stats.leases == 1 and stats.groups_ready == 2
        await store.ack(theirs.lease_id, 0)

    run(go())


def test_rows_a_rewind_may_need_outlive_the_pruner(open_store, tmp_path):
    store = open_store(keep_consumed=0)
    path = tmp_path / "buffer.sqlite"

    async def consume():
        await fill(store, "abcd")
        await train(store, range(4))

    run(consume())
    # the pruner's pass after the last ack is done: no checkpoint yet, every row is held
    assert eventually(lambda: store.pruner.due is None)
    assert [rows(path, f"{t}@v0") for t in "abcd"] == [2, 2, 2, 2]
    run(store.checkpointed(2))  # steps 0 and 1 can never be rewound now
    assert eventually(lambda: rows(path, "a@v0") == 0 and rows(path, "b@v0") == 0)
    assert rows(path, "c@v0") == 2 and rows(path, "d@v0") == 2
    with pytest.raises(RewindTooFar, match="cannot rewind to step 1: 1 groups"):
        run(store.rewind(1))
    assert run(store.stats()).groups_ready == 0  # refused whole: nothing changed
    outcome = run(store.rewind(2))
    assert outcome.groups == 2
    lease = run(store.sample(2))
    assert sorted(e.group_id for e in lease.experiences) == ["c@v0"] * 2 + ["d@v0"] * 2


def test_a_database_from_before_rewind_is_migrated(tmp_path, clock):
    path = tmp_path / "buffer.sqlite"
    store = SqliteStore(path, clock=clock, synchronous="normal")
    run(fill(store, "a"))
    store.close_sync()
    db = sqlite3.connect(path)  # what an older buffer left: no step, no holder, no uses
    db.execute("DROP TABLE uses")
    db.execute("DROP INDEX leases_holder")
    for table, column in (("groups", "step"), ("leases", "holder")):
        db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    db.commit()
    db.close()
    store = SqliteStore(path, clock=clock, synchronous="normal")
    try:
        assert run(train(store, range(1))) == [["a@v0"]]
        assert run(store.rewind(0)).groups == 1
    finally:
        store.close_sync()


async def test_rewind_release_and_checkpoint_over_the_wire(tmp_path, zmq_sockets_closed):
    async with Running(config_for(tmp_path, "buffer.lease_seconds=3600")) as b:
        await b.call(PutExperiences(experiences=make_group("a", 2) + make_group("b", 2),
                                    group_size=2))
        first = await b.call(SampleGroups(num_groups=1, holder="trainer"))
        await b.call(AckLease(lease_id=first.lease_id, step=0))
        await b.call(SampleGroups(num_groups=1, holder="trainer"))  # then the trainer died
        released = await b.call(ReleaseLeases(holder="trainer"))
        assert released.leases == 1
        await b.call(CheckpointSaved(step=0))
        rewound = await b.call(RewindTo(step=0))
        assert (rewound.groups, rewound.uses, rewound.leases_released) == (1, 1, 0)
        stats = await b.call(GetBufferStats())
        assert stats.groups_ready == 2 and stats.leases == 0
        sample = await b.call(SampleGroups(num_groups=2, holder="trainer"))
        await b.call(AckLease(lease_id=sample.lease_id, step=0))
        await b.call(CheckpointSaved(step=1))
        async def pruned() -> bool:
            return (await b.call(GetBufferStats())).bytes == 0

        await until(pruned, "the pruner deleting the rows step 0 consumed")
        with pytest.raises(RequestFailed) as info:
            await b.call(RewindTo(step=0))
        assert info.value.code == "rewind_too_far" and "resume from" in info.value.message
