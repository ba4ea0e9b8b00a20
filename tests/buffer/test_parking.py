"""Waiting samples are bounded per client and in time: a flood cannot deny other clients."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from backstop import BACKSTOP
from processes import until
from buffer_helpers import Running, config_for, make_group, parked
from tandem.common import codec
from tandem.common.errors import RequestFailed
from tandem.common.messages import PutExperiences, ReleaseLeases, SampleGroups
from tandem.common.rpc import RpcClient

FLOOD = 4_200  # more than the RPC server's 4,096 requests in flight


async def replies(sock, want: int, within: float) -> list[str]:
    """Error codes of up to `want` replies that arrive on `sock` within `within` seconds."""
    codes: list[str] = []
    deadline = time.monotonic() + within
    while len(codes) < want and (left := deadline - time.monotonic()) > 0:
        if not await sock.poll(left * 1000):
            break
        header, _ = codec.decode_header(await sock.recv_multipart(copy=False))
        codes.append((header.get("error") or {}).get("code", "ok"))
    return codes


async def test_a_flood_of_waiting_samples_does_not_deny_another_client(
        tmp_path, zmq_sockets_closed):
    async with Running(config_for(tmp_path)) as b:
        flood = b.buffer.server.factory.dealer(b.buffer.bound, "flood")
        try:
            # valid requests that can never be served, each asking to wait practically forever
            ask = SampleGroups(num_groups=1_000, wait=1e9)
            for _ in range(FLOOD):
                await flood.send_multipart(codec.encode_request(ask, uuid.uuid4().hex, ttl=1e9))
            most = b.buffer.config.buffer.max_parked_per_client
            await parked(b, most)  # the flood is in: the flooder holds all its waiting slots
            put = await b.call(PutExperiences(experiences=make_group("a", 2), group_size=2))
            assert put.stored == 2
            sample = await b.call(SampleGroups(num_groups=1, wait=BACKSTOP))
            assert sample.group_ids == ["a@v0"]
            # the flooder itself is answered: every request but the newest few, at once
            answered = await replies(flood, FLOOD - most, within=BACKSTOP)
            assert len(answered) == FLOOD - most
            assert set(answered) <= {"not_enough", "busy"}
        finally:
            flood.close(linger=0)
        # the flooder is gone; its parked samples end within buffer.max_sample_wait at most,
        # and meanwhile nobody else is refused
        put = await b.call(PutExperiences(experiences=make_group("b", 2), group_size=2))
        assert put.stored == 2


async def test_a_newer_sample_from_the_same_client_supersedes_the_oldest(
        tmp_path, zmq_sockets_closed):
    async with Running(config_for(tmp_path, "buffer.max_parked_per_client=1",
                                  f"buffer.max_sample_wait={BACKSTOP}")) as b:
        first = asyncio.create_task(b.call(SampleGroups(num_groups=1, wait=BACKSTOP)))
        await parked(b)
        second = asyncio.create_task(b.call(SampleGroups(num_groups=1, wait=BACKSTOP)))
        with pytest.raises(RequestFailed, match="superseded by a newer sample") as info:
            await first
        assert info.value.code == "not_enough"
        await b.call(PutExperiences(experiences=make_group("a", 2), group_size=2))
        sample = await second  # the newer one still waits, and is served
        assert sample.group_ids == ["a@v0"]


async def test_a_wait_is_capped_by_max_sample_wait(tmp_path, zmq_sockets_closed):
    async with Running(config_for(tmp_path, "buffer.max_sample_wait=0.4")) as b:
        # told it may take twice the caller's BACKSTOP: uncapped, the wait outlasts the call
        with pytest.raises(RequestFailed, match="after waiting") as info:
            await b.call(SampleGroups(num_groups=1, wait=1e9), ttl=2 * BACKSTOP)
        assert info.value.code == "not_enough"


async def test_one_client_cannot_take_every_request_slot_of_a_server(zmq_sockets_closed):
    """The RPC server's side of the same promise, with handlers that never finish by
    themselves: one client holds at most `max_inflight_per_peer` of the `max_inflight` slots."""
    from tandem.common.messages import AckLease, Ok
    from tandem.common.rpc import RpcServer

    release = asyncio.Event()
    held = 0

    async def park(msg, ctx):
        nonlocal held
        held += 1
        await release.wait()
        return Ok()

    server = RpcServer("tcp://127.0.0.1:0", name="parking", max_inflight=64,
                       max_inflight_per_peer=16)
    server.register(AckLease, park)
    address = await server.start()
    flood = server.factory.dealer(address, "flood")
    other = RpcClient(address, peer="parking", name="other")
    try:
        for _ in range(100):
            await flood.send_multipart(codec.encode_request(AckLease(lease_id="x"), uuid.uuid4().hex,
                                                            ttl=1e9))
        codes = await replies(flood, 100 - 16, within=BACKSTOP)
        assert codes == ["busy"] * (100 - 16)  # refused at once, beyond its share
        calls = [asyncio.create_task(other.call(AckLease(lease_id="y"), timeout=BACKSTOP,
                                                retries=0))
                 for _ in range(16)]
        await until(lambda: held == 32, "the other client's 16 calls in their handlers")
        release.set()
        assert all(isinstance(r, Ok) for r in await asyncio.gather(*calls))
    finally:
        release.set()
        flood.close(linger=0)
        await other.close()
        await server.close()


async def test_releasing_a_holder_ends_its_dead_incarnations_waiting_sample(
        tmp_path, zmq_sockets_closed):
    """A restarted trainer (a new client) releases its holder's leases: the sample its dead
    incarnation left waiting must not lease the groups the new one is about to sample."""
    async with Running(config_for(tmp_path, f"buffer.max_sample_wait={BACKSTOP}")) as b:
        dead = RpcClient(b.buffer.bound, peer="buffer", name="trainer-dead")
        try:
            orphan = asyncio.create_task(dead.call(
                SampleGroups(num_groups=1, wait=BACKSTOP, holder="trainer"), timeout=BACKSTOP,
                retries=0))
            await parked(b)
            released = await b.call(ReleaseLeases(holder="trainer"))
            assert released.leases == 0
            with pytest.raises(RequestFailed, match="its holder 'trainer' released its leases"):
                await orphan
            await b.call(PutExperiences(experiences=make_group("a", 2), group_size=2))
            sample = await b.call(SampleGroups(num_groups=1, holder="trainer"))
            assert sample.group_ids == ["a@v0"]
        finally:
            await dead.close()
