"""The Buffer service over real loopback sockets: RPC round trips, waiting samples, errors."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from backstop import BACKSTOP
from buffer_helpers import Running, config_for, make_group, parked
from tandem.common.errors import RequestFailed
from tandem.common.messages import (
    AckLease, BufferStats, GetBufferStats, PutExperiences, ReleaseLease, SampleGroups,
)

async def test_put_sample_ack_release_over_the_wire(tmp_path, zmq_sockets_closed):
    groups = make_group("a", 4, tokens=4096, prompt_len=96) + make_group("b", 4)
    async with Running(config_for(tmp_path)) as b:
        put = await b.call(PutExperiences(experiences=groups, group_size=4))
        assert (put.stored, put.duplicates) == (8, 0)
        again = await b.call(PutExperiences(experiences=groups[:4], group_size=4))
        assert (again.stored, again.duplicates) == (0, 4)
        sample = await b.call(SampleGroups(num_groups=2, policy="fifo"))
        assert sample.group_ids == ["a@v0", "b@v0"]
        for got, want in zip(sample.experiences, groups):
            assert got.id == want.id and got.tokens.tobytes() == want.tokens.tobytes()
            assert got.logprobs.tobytes() == want.logprobs.tobytes()
            assert got.action_mask.tobytes() == want.action_mask.tobytes()
        await b.call(ReleaseLease(lease_id=sample.lease_id))
        sample = await b.call(SampleGroups(num_groups=1))
        await b.call(AckLease(lease_id=sample.lease_id))
        with pytest.raises(RequestFailed) as info:
            await b.call(AckLease(lease_id=sample.lease_id))
        assert info.value.code == "unknown_lease"
        stats = await b.call(GetBufferStats())
        assert isinstance(stats, BufferStats)
        assert stats.by_state["consumed"] == 4 and stats.by_state["ready"] == 4
        assert stats.by_version == {0: 4} and stats.db_bytes > 0


async def test_sample_waits_for_a_put(tmp_path):
    async with Running(config_for(tmp_path, f"buffer.max_sample_wait={BACKSTOP}")) as b:
        async def late_put():
            await parked(b)  # the sample waits, with nothing to lease
            await b.call(PutExperiences(experiences=make_group("a", 2), group_size=2))

        putter = asyncio.create_task(late_put())
        sample = await b.call(SampleGroups(num_groups=1, wait=BACKSTOP))
        await putter
        assert sample.group_ids == ["a@v0"]


async def test_not_enough_after_waiting(tmp_path):
    async with Running(config_for(tmp_path, f"buffer.max_sample_wait={2 * BACKSTOP}")) as b:
        await b.call(PutExperiences(experiences=make_group("a", 2), group_size=2))
        started = time.monotonic()
        with pytest.raises(RequestFailed) as info:
            await b.call(SampleGroups(num_groups=3, wait=0.4))
        assert time.monotonic() - started >= 0.4
        assert info.value.code == "not_enough"
        waited = re.fullmatch(r"not enough experiences \(have 1 ready groups, need 3\), "
                              r"after waiting (\d+\.\d) s", info.value.message)
        assert waited and float(waited[1]) >= 0.4, info.value.message
        # a wait longer than the caller's deadline (its ttl) ends at that deadline: uncapped,
        # it would outlast the caller's own BACKSTOP and the call would fail with PeerDead
        with pytest.raises(RequestFailed, match="not enough"):
            await b.call(SampleGroups(num_groups=3, wait=2 * BACKSTOP), ttl=0.5)


async def test_full_answers_retry_after(tmp_path):
    config = config_for(tmp_path, "buffer.capacity=4", "buffer.retry_after=0.2")
    async with Running(config) as b:
        await b.call(PutExperiences(experiences=make_group("a", 4), group_size=4))
        with pytest.raises(RequestFailed) as info:
            await b.call(PutExperiences(experiences=make_group("b", 4), group_size=4))
        assert info.value.code == "full" and info.value.retry_after == 0.2


async def test_group_size_from_the_explorers_config(tmp_path):
    config = config_for(tmp_path, "explorers.0.repeat_times=2", "explorers.1.name=explorer-1",
                        "explorers.1.repeat_times=3")
    async with Running(config) as b:
        put = await b.call(PutExperiences(
            experiences=make_group("a", 2) + make_group("b", 3, explorer="explorer-1")))
        assert put.stored == 5
        assert (await b.call(GetBufferStats())).groups_ready == 2
        with pytest.raises(RequestFailed) as info:
            await b.call(PutExperiences(experiences=make_group("c", 2, explorer="other")))
        assert info.value.code == "bad_request" and "send group_size" in info.value.message


async def test_waiting_sample_gets_groups_back_from_an_expired_lease(tmp_path):
    async with Running(config_for(tmp_path, f"buffer.max_sample_wait={BACKSTOP}")) as b:
        await b.call(PutExperiences(experiences=make_group("a", 2), group_size=2))
        first = await b.call(SampleGroups(num_groups=1, lease_seconds=0.3))
        second = await b.call(SampleGroups(num_groups=1, wait=BACKSTOP))
        assert second.group_ids == first.group_ids and second.lease_id != first.lease_id
        assert second.expires_at > first.expires_at
