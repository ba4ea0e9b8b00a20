"""SqliteStore on a real SQLite file: put, groups, leases, policies, capacity, retention."""

from __future__ import annotations

import asyncio
import sqlite3

import numpy as np
import pytest

from tandem.buffer import (
    BadPut, BufferFull, NotEnoughExperiences, SqliteStore, UnknownLease, group_priority,
)
from tandem.common.errors import TandemError

from buffer_helpers import make_group


def run(coro):
    return asyncio.run(coro)


async def put(store, experiences, size):
    return await store.put(experiences, [size] * len(experiences))


def test_arrays_round_trip_bit_identical(open_store):
    store = open_store()
    exps = make_group("t", 2, tokens=1024, prompt_len=100)
    exps[0].logprobs[3] = np.float32("nan")
    exps[0].logprobs.view(np.uint32)[4] = 0x7FC00001  # a NaN with a payload
    exps[1].info = {"turns": 3, "note": "x", "score": np.float32(0.5)}

    async def go():
        await put(store, exps, 2)
        return await store.sample(1)

    lease = run(go())
    assert [e.id for e in lease.experiences] == [e.id for e in exps]
    for got, want in zip(lease.experiences, exps):
        for name in ("tokens", "action_mask", "logprobs"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        assert (got.reward, got.prompt_len, got.policy_version) == (
            want.reward, want.prompt_len, want.policy_version)
    assert lease.experiences[1].info == {"turns": 3, "note": "x", "score": 0.5}


def test_put_is_idempotent_and_groups_wait_until_complete(open_store):
    store = open_store()
    group = make_group("t", 4)

    async def go():
        first = await put(store, group[:3] + group[:1], 4)
        assert (first.stored, first.duplicates) == (3, 1)
        with pytest.raises(NotEnoughExperiences, match=r"have 0 ready groups, need 1"):
            await store.sample(1)
        second = await put(store, group, 4)
        assert (second.stored, second.duplicates) == (1, 3)
        stats = await store.stats()
        assert stats.by_state["ready"] == 4 and stats.groups_ready == 1
        lease = await store.sample(1)
        assert sorted(e.id for e in lease.experiences) == sorted(e.id for e in group)

    run(go())


def test_put_rejects_contradictions(open_store):
    store = open_store()

    async def go():
        await put(store, make_group("t", 2), 4)
        with pytest.raises(BadPut, match="group_size 4"):
            await put(store, make_group("t", 4)[2:], 3)
        with pytest.raises(BadPut, match="would hold 5"):
            await put(store, make_group("t", 5), 4)
        with pytest.raises(BadPut, match="would hold 3 experiences but its group_size is 2"):
            await put(store, make_group("u", 3), 2)
        stats = await store.stats()
        assert stats.by_state["waiting"] == 2  # the rejected puts stored nothing

    run(go())


def test_capacity_backpressure(open_store):
    store = open_store(capacity=6, retry_after=0.25)

    async def go():
        await put(store, make_group("a", 4), 4)
        with pytest.raises(BufferFull) as info:
            await put(store, make_group("b", 4), 4)
        assert info.value.retry_after == 0.25  # the code "full" is the service's (test_service)
        assert "buffer.capacity=6" in info.value.message
        again = await put(store, make_group("a", 4), 4)  # duplicates need no room
        assert again.duplicates == 4
        lease = await store.sample(1)
        await store.ack(lease.lease_id)
        assert (await put(store, make_group("b", 4), 4)).stored == 4

    run(go())


def test_lease_ack_release_and_expiry(open_store, clock):
    store = open_store(lease_seconds=10)

    async def go():
        await put(store, make_group("a", 2) + make_group("b", 2), 2)
        lease = await store.sample(2)
        with pytest.raises(NotEnoughExperiences):
            await store.sample(1)
        await store.release(lease.lease_id)
        with pytest.raises(UnknownLease):
            await store.ack(lease.lease_id)
        lease = await store.sample(1)
        clock.now += 10
        with pytest.raises(UnknownLease, match="expired"):
            await store.ack(lease.lease_id)
        again = await store.sample(2)
        await store.ack(again.lease_id)
        stats = await store.stats()
        assert stats.by_state["consumed"] == 4 and stats.leases == 0

    run(go())


def test_a_step_gathers_its_groups_in_parts_and_acks_them_at_once(open_store):
    """min_groups: a sample leases the groups there are once that many are ready (issue 27 item
    5); an ack with `more` consumes every lease it names, or (one unknown) none of them."""
    store = open_store()

    async def go():
        await put(store, make_group("a", 2), 2)
        first = await store.sample(3, min_groups=1)
        assert len(first.group_ids) == 1  # the one there is, not all three
        with pytest.raises(NotEnoughExperiences, match=r"have 0 ready groups, need 1"):
            await store.sample(2, min_groups=1)
        await put(store, make_group("b", 2) + make_group("c", 2) + make_group("d", 2), 2)
        second = await store.sample(2, min_groups=1)  # never more than asked
        assert len(second.group_ids) == 2
        with pytest.raises(BadPut, match="min_groups must be between 1 and num_groups"):
            await store.sample(1, min_groups=2)
        with pytest.raises(UnknownLease):
            await store.ack(first.lease_id, 0, more=[second.lease_id, "nope"])
        stats = await store.stats()
        assert stats.by_state["consumed"] == 0 and stats.leases == 2  # none of them
        await store.ack(first.lease_id, 0, more=[second.lease_id])
        stats = await store.stats()
        assert stats.by_state["consumed"] == 6 and stats.leases == 0
        assert stats.groups_ready == 1

    run(go())


def test_fifo_newest_and_priority_order(open_store):
    store = open_store(priority="reward_variance")

    async def go():
        await put(store, make_group("a", 2, version=2, rewards=[0, 0]), 2)
        await put(store, make_group("b", 2, version=1, rewards=[0, 4]), 2)
        await put(store, make_group("c", 2, version=3, rewards=[0, 1]), 2)
        await put(store, make_group("d", 2, version=1, rewards=[1, 1]), 2)
        orders = {}
        for policy in ("fifo", "newest", "priority"):
            lease = await store.sample(4, policy=policy)
            orders[policy] = [g.split("@")[0] for g in lease.group_ids]
            await store.release(lease.lease_id)
        return orders

    assert run(go()) == {"fifo": ["b", "d", "a", "c"], "newest": ["c", "a", "d", "b"],
                         "priority": ["b", "c", "a", "d"]}


def test_staleness_filter_drops_and_counts(open_store):
    store = open_store()

    async def go():
        await put(store, make_group("old", 2, version=0), 2)
        await put(store, make_group("half", 2, version=0)[:1], 2)
        await put(store, make_group("new", 2, version=3), 2)
        with pytest.raises(NotEnoughExperiences, match="dropped 3 stale"):
            await store.sample(2, min_version=2)
        lease = await store.sample(1, min_version=2)
        assert lease.group_ids == ["new@v3"]
        late = await put(store, make_group("half", 2, version=0)[1:], 2)
        assert (late.stored, late.duplicates, late.dropped_stale) == (0, 0, 1)
        stats = await store.stats()
        assert stats.dropped_stale == 4 and stats.by_state["stale"] == 3
        with pytest.raises(NotEnoughExperiences):
            await store.sample(1, max_version=2)

    run(go())


def test_reuse_replays_fresh_groups_first(open_store):
    store = open_store(reuse=2)

    async def go():
        await put(store, make_group("a", 2), 2)
        first = await store.sample(1)
        await store.ack(first.lease_id)
        await put(store, make_group("b", 2), 2)
        second = await store.sample(1)
        assert second.group_ids == ["b@v0"]  # unused before replayed
        await store.ack(second.lease_id)
        third = await store.sample(2)
        assert third.group_ids == ["a@v0", "b@v0"]
        await store.ack(third.lease_id)
        with pytest.raises(NotEnoughExperiences):
            await store.sample(1)

    run(go())


def test_retention_keeps_newest_consumed_rows(open_store, tmp_path):
    store = open_store(keep_consumed=4)

    async def go():
        for task in "abcd":
            await put(store, make_group(task, 2), 2)
            lease = await store.sample(1)
            await store.ack(lease.lease_id)
        late = await put(store, make_group("a", 2), 2)  # consumed and deleted: still a duplicate
        assert late.duplicates == 2
        return await store.stats()

    stats = run(go())
    assert stats.by_state["consumed"] == 8
    store.close_sync()
    rows = sqlite3.connect(tmp_path / "buffer.sqlite").execute(
        "SELECT DISTINCT group_id FROM experiences ORDER BY group_id").fetchall()
    assert rows == [("c@v0",), ("d@v0",)]


def test_concurrent_puts_share_commits(open_store):
    store = open_store()

    async def go():
        before = store.commits
        results = await asyncio.gather(*(
            put(store, make_group(f"t{i}", 4), 4) for i in range(40)))
        assert sum(r.stored for r in results) == 160
        return store.commits - before

    assert run(go()) < 40


def test_state_survives_reopen(tmp_path, clock):
    path = tmp_path / "buffer.sqlite"
    store = SqliteStore(path, clock=clock, lease_seconds=5)

    async def first():
        await put(store, make_group("a", 2) + make_group("b", 2), 2)
        return await store.sample(1)

    lease = run(first())
    store.close_sync()
    store = SqliteStore(path, clock=clock, lease_seconds=5)

    async def second():
        with pytest.raises(NotEnoughExperiences, match="have 1"):
            await store.sample(2)
        await store.ack(lease.lease_id)  # the lease outlived the restart
        assert (await put(store, make_group("a", 2), 2)).duplicates == 2
        return await store.stats()

    stats = run(second())
    store.close_sync()
    assert stats.by_state["consumed"] == 2 and stats.by_state["ready"] == 2


@pytest.mark.parametrize("kind, rewards, infos, key, want", [
    ("reward_variance", [0, 1, 0, 1], [{}] * 4, None, 0.25),
    ("advantage", [0, 0, 0, 4], [{}] * 4, None, 1.5),
    ("advantage", [0, 0], [{"advantage": -2}, {"advantage": 1}], None, 1.5),
    ("key", [0, 0], [{"difficulty": 3}, {"other": 1}], "difficulty", 3.0),
    ("key", [0], [{}], "difficulty", 0.0),
])
def test_group_priority(kind, rewards, infos, key, want):
    assert group_priority(kind, rewards, infos, key) == pytest.approx(want)


def test_closed_store_refuses_work(open_store):
    store = open_store()
    store.close_sync()
    with pytest.raises(Exception, match="closed"):
        run(store.stats())


def test_unstorable_info_is_a_clear_error(open_store):
    store = open_store()
    exps = make_group("t", 2)
    exps[1].info = {"tensor": object()}
    with pytest.raises(BadPut, match=f"experience {exps[1].id}: info or rewards cannot be stored"):
        run(put(store, exps, 2))
    assert run(store.stats()).by_state["waiting"] == 0


def test_stats_by_version_and_bytes(open_store):
    store = open_store()

    async def go():
        await put(store, make_group("a", 2, version=1, tokens=40, prompt_len=8), 2)
        await put(store, make_group("b", 3, version=5, tokens=40, prompt_len=8)[:2], 3)
        return await store.stats()

    stats = run(go())
    assert stats.by_version == {1: 2, 5: 2}
    assert (stats.oldest_version, stats.newest_version) == (1, 5)
    assert stats.groups_waiting == 1 and stats.groups_ready == 1
    assert stats.bytes == 4 * (40 * 4 + 32 + 32 * 4)


def test_rows_of_consumed_groups_go_even_when_never_idle(open_store, tmp_path, monkeypatch):
    monkeypatch.setattr("tandem.buffer.pruner.AT_LEAST_EVERY", 0.5)  # moved with the pruner
    store = open_store()

    async def go():
        await put(store, make_group("a", 2) + make_group("b", 2), 2)
        lease = await store.sample(2)
        await store.ack(lease.lease_id)
        started = asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - started < 1.2:
            await store.stats()  # back to back: the store never sits idle for 20 ms

    def rows() -> int:
        db = sqlite3.connect(tmp_path / "buffer.sqlite")
        try:
            return db.execute("SELECT count(*) FROM experiences").fetchone()[0]
        finally:
            db.close()

    run(go())
    assert rows() == 0


def test_a_second_store_on_the_same_file_is_refused(open_store, tmp_path):
    open_store()
    with pytest.raises(TandemError, match="another buffer is using .*buffer.sqlite"):
        SqliteStore(tmp_path / "buffer.sqlite")
