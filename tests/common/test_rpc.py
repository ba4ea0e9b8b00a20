"""RPC over real loopback sockets: replies, error replies, garbage, retries answered once, silence."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from backstop import BACKSTOP, PATIENT
from tandem.common.errors import PeerDead, RequestFailed
from tandem.common.messages import (
    AckLease, BufferStats, GetBufferStats, Heartbeat, HeartbeatAck, Ok, ReleaseLease,
)
from tandem.common.rpc import RpcClient, RpcServer

# a call that should be answered waits for it however slow the machine is; a test that wants
# silence to run out says how long it listens


def stats(calls: int = 0) -> BufferStats:
    return BufferStats(by_state={"calls": calls}, by_version={}, oldest_version=None,
                       newest_version=None, bytes=0, groups_waiting=0, groups_ready=0,
                       dropped_stale=0, capacity=1)


async def test_call_error_reply_and_unsupported(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="buffer", transport=PATIENT)

    @server.handler(GetBufferStats)
    async def on_stats(msg, ctx):
        assert ctx.remaining() > 0
        return stats()

    @server.handler(AckLease)
    async def on_ack(msg, ctx):
        raise RequestFailed("unknown_lease", f"no lease {msg.lease_id}", retry_after=0.5)

    address = await server.start()
    assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
    client = RpcClient(address, peer="buffer", transport=PATIENT)
    try:
        assert isinstance(await client.call(GetBufferStats()), BufferStats)
        assert isinstance(await client.call(Heartbeat(name="t")), HeartbeatAck)
        with pytest.raises(RequestFailed) as err:
            await client.call(AckLease(lease_id="L1"))
        assert err.value.code == "unknown_lease" and err.value.retry_after == 0.5
        with pytest.raises(RequestFailed, match="buffer does not handle 'buffer.release'"):
            await client.call(ReleaseLease(lease_id="x"))
    finally:
        await client.close()
        await server.close()


async def test_handler_crash_is_an_error_reply_and_server_survives(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="svc", transport=PATIENT)

    @server.handler(AckLease)
    async def on_ack(msg, ctx):
        raise ZeroDivisionError("boom")

    client = RpcClient(await server.start(), peer="svc", transport=PATIENT)
    try:
        with pytest.raises(RequestFailed) as err:
            await client.call(AckLease(lease_id="x"))
        assert err.value.code == "internal" and "ZeroDivisionError: boom" in err.value.message
        assert isinstance(await client.call(Heartbeat(name="t")), HeartbeatAck)
    finally:
        await client.close()
        await server.close()


async def test_garbage_gets_bad_request_or_counted_drop(zmq_sockets_closed):
    import msgpack

    server = RpcServer("tcp://127.0.0.1:0", name="svc", transport=PATIENT)
    address = await server.start()
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        await raw.send_multipart([b"\xff\x00garbage"])
        await raw.send_multipart([msgpack.packb({"v": 1, "type": "no.such", "id": "abc", "body": {}})])
        reply = await asyncio.wait_for(raw.recv_multipart(), BACKSTOP)
        header = msgpack.unpackb(reply[0])
        assert header["id"] == "abc" and header["ok"] is False
        assert header["error"]["code"] == "bad_request" and "no.such" in header["error"]["message"]
        assert server.dropped == 1
        client = RpcClient(address, peer="svc", transport=PATIENT)
        assert isinstance(await client.call(Heartbeat(name="t")), HeartbeatAck)
        await client.close()
    finally:
        raw.close(linger=0)
        await server.close()


async def test_retry_with_same_id_is_answered_once(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="slow", transport=PATIENT)
    calls = 0

    @server.handler(GetBufferStats)
    async def on_stats(msg, ctx):
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.35)
        return stats(calls)

    client = RpcClient(await server.start(), peer="slow", transport=PATIENT)
    try:
        # Each attempt waits 0.1 s, so the request is sent again while the first is served.
        reply = await client.call(GetBufferStats(), timeout=0.1, retries=int(BACKSTOP / 0.1))
        assert reply.by_state == {"calls": 1}
        assert calls == 1
    finally:
        await client.close()
        await server.close()


async def test_pipelined_calls_are_matched_to_their_replies(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="echo", transport=PATIENT)

    @server.handler(AckLease)
    async def on_ack(msg, ctx):
        await asyncio.sleep(0.001 * (int(msg.lease_id) % 7))
        raise RequestFailed("echo", msg.lease_id)

    client = RpcClient(await server.start(), peer="echo", transport=PATIENT)

    async def one(i):
        try:
            await client.call(AckLease(lease_id=str(i)))
        except RequestFailed as exc:
            return exc.message

    try:
        assert await asyncio.gather(*[one(i) for i in range(200)]) == [str(i) for i in range(200)]
    finally:
        await client.close()
        await server.close()


async def test_silent_peer_is_peer_dead_naming_it_and_the_key(zmq_sockets_closed):
    client = RpcClient("tcp://127.0.0.1:9", peer="master", transport=PATIENT)
    start = time.monotonic()
    try:
        with pytest.raises(PeerDead) as err:
            await client.call(GetBufferStats(), timeout=0.2, retries=1, timeout_key="master.timeout")
    finally:
        await client.close()
    assert time.monotonic() - start > 0.35 and err.value.bound == pytest.approx(0.4)
    assert err.value.peer == "master" and "(2 attempts of 0.2s)" in str(err.value)
    assert "master at tcp://127.0.0.1:9" in str(err.value) and "master.timeout" in str(err.value)


async def test_a_port_held_by_another_kind_of_socket_is_peer_dead_not_a_hang(
        zmq_sockets_closed):
    # `tandem up` once gave the master's RPC and publish addresses one port; `up` then called a
    # PUB socket: the handshake failed, the DEALER had no peer, and its second send never returned
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    client = RpcClient(f"tcp://127.0.0.1:{port}", peer="master", transport=PATIENT)
    try:
        for _ in range(3):
            with pytest.raises(PeerDead) as err:  # a send that never returned is a hang
                await asyncio.wait_for(client.call(GetBufferStats(), timeout=0.3, retries=1),
                                       BACKSTOP)
            assert err.value.bound == pytest.approx(0.6)  # two attempts of 0.3 s, not for ever
    finally:
        await client.close()
        pub.close()


async def test_server_restart_is_survived_by_retries(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="svc", transport=PATIENT)
    address = await server.start()
    client = RpcClient(address, peer="svc", transport=PATIENT)
    try:
        await client.call(Heartbeat(name="t"))
        await server.close()
        server = RpcServer(address, name="svc", transport=PATIENT)
        await server.start()
        # resent every 0.5 s: the first attempt may go to the closed server's connection
        reply = await client.call(Heartbeat(name="t"), timeout=0.5, retries=int(BACKSTOP / 0.5))
        assert isinstance(reply, HeartbeatAck)
    finally:
        await client.close()
        await server.close()


async def test_ok_reply_for_handlers_returning_none(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="svc", transport=PATIENT)

    @server.handler(ReleaseLease)
    async def on_release(msg, ctx):
        return None

    client = RpcClient(await server.start(), peer="svc", transport=PATIENT)
    try:
        assert isinstance(await client.call(ReleaseLease(lease_id="x")), Ok)
    finally:
        await client.close()
        await server.close()


@pytest.mark.parametrize("header", [
    {"v": 1, "type": "reply", "id": "r1", "ok": True, "result_type": "ok", "result": {}},
    {"v": 1, "type": "reply", "id": "r1", "ok": False,
     "error": {"code": "x", "message": "y"}},
])
async def test_a_reply_sent_to_a_server_is_a_bad_request_without_traceback(
        header, zmq_sockets_closed):
    import msgpack
    from structlog.testing import capture_logs

    server = RpcServer("tcp://127.0.0.1:0", name="svc", transport=PATIENT)
    address = await server.start()
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        with capture_logs() as logs:
            await raw.send_multipart([msgpack.packb(header)])
            reply = msgpack.unpackb((await asyncio.wait_for(raw.recv_multipart(), BACKSTOP))[0])
        assert reply["id"] == "r1" and reply["ok"] is False
        assert reply["error"]["code"] == "bad_request"
        assert "got a reply (r1) where a request was expected" in reply["error"]["message"]
        assert not [e for e in logs if e["log_level"] in ("error", "exception", "critical")]
    finally:
        raw.close(linger=0)
        await server.close()


def test_free_ports_are_never_handed_out_twice():
    from tandem.common.sockets import free_port

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_a_free_port_is_one_no_other_socket_can_be_given_meanwhile():
    """The port is bound by its process seconds later (after its imports); until then no
    `bind(0)` (a /metrics endpoint on port 0, an srun's listener) nor the local end of a
    `connect()` may take it, so it lies outside the kernel's ephemeral range, and it is free on
    every address, for a server that binds 0.0.0.0."""
    import socket

    from tandem.common.sockets import FIXED_PORTS, ephemeral_ports, free_port

    ephemeral = ephemeral_ports()
    for _ in range(50):
        port = free_port()
        assert port not in ephemeral, (port, ephemeral)
        assert not any(port in fixed for fixed in FIXED_PORTS), port
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", port))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        assert taken.getsockname()[1] in ephemeral  # what the kernel hands a bind(0)


def test_peer_names_are_readable_and_one_to_one():
    from tandem.common.rpc import peer_name
    from tandem.common.sockets import new_identity

    mine = new_identity("explorer-0")
    assert peer_name(mine) == mine.decode()
    generated = b"\x00k\x8bEg"  # what ZeroMQ gives a socket without an identity
    assert peer_name(generated) == "<0x006b8b4567>"
    assert peer_name(b"a\nb") == "<0x610a62>"  # no control characters in a log line
    assert peer_name(b"<0x006b8b4567>") != peer_name(generated)  # no one poses as another
