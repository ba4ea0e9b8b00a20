"""Hostile input costs bounded memory: limits are checked before decoding, and what a flood of
malformed messages leaves behind (frames, heap, logs, caches) is bounded."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from backstop import BACKSTOP, PATIENT
from tandem.common import codec
from tandem.common.config import TransportConfig
from tandem.common.messages import GetBufferStats, Heartbeat, HeartbeatAck
from tandem.common.messages.reward import ScoreBatch, Scores
from tandem.common.rpc import RpcClient, RpcServer



def score_batch_frames(n: int, id_: str = "big") -> list[bytes]:
    """A valid ScoreBatch of `n` items, written directly (19 MB for a million)."""
    item = msgpack.packb({"fn": "math", "response": "42", "truth": "42"})
    head = msgpack.packb({"v": 1, "type": "reward.score", "id": id_, "ttl": 5.0})
    body = b"\x81" + msgpack.packb("items") + b"\xdd" + struct.pack(">I", n) + item * n
    return [bytes([head[0] + 1]) + head[1:] + msgpack.packb("body") + body]


def nested(depth: int, id_: str = "deep") -> bytes:
    head = msgpack.packb({"v": 1, "type": "master.register", "id": id_})
    body = b"\x81" + msgpack.packb("meta") + b"\x81\xa1k" * depth + b"\xc0"
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("body") + body


def test_a_bounded_list_is_refused_from_its_raw_header_before_anything_is_built():
    frames = score_batch_frames(1_000_000)
    limits = codec.Limits(items={"reward.score": {"items": (4096, "reward.max_batch")}})
    tracemalloc.start()
    try:
        with pytest.raises(codec.LimitExceeded,
                           match=r"reward.score: items has 1000000 items, more than the 4096 "
                                 r"this receiver takes \(reward.max_batch\)"):
            codec.decode_header(frames, limits=limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # decoding it would build a million dicts (about 1 GB)
    ok = score_batch_frames(4096)
    assert len(codec.decode(ok, limits=limits).body.items) == 4096


@pytest.mark.parametrize("frames, match", [
    ([nested(40)], r"nested deeper than 32 levels \(transport.max_depth\)"),
    ([nested(5000)], r"nested deeper than msgpack decodes"),
    ([b"\x81\xa1a" + b"\xdd" + struct.pack(">I", 100_000) + b"\xc0" * 100_000],
     r"more than 65536 items \(transport.max_items\)"),
    ([b"\x80"] * 16385, r"16385 frames exceeds the limit of 16384 frames \(transport.max_frames\)"),
])
def test_depth_items_and_frames_are_limited(frames, match):
    with pytest.raises(codec.LimitExceeded, match=match):
        codec.decode_header(frames)


def test_lying_headers_allocate_nothing_and_say_so():
    for raw in (b"\xdd\xff\xff\xff\xff\xc0", b"\xdf\xff\xff\xff\xff", b"\xdb\x80\x00\x00\x00xx",
                b"\x81\xa4body\xdd\xff\xff\xff\xff"):
        with pytest.raises(codec.ProtocolError, match="not valid msgpack"):
            codec.decode_header([raw])


async def _raw_dealer(address: str):
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


async def test_server_refuses_too_large_requests_with_a_reply_and_serves_on(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="reward", transport=TransportConfig(
        rpc_timeout=2.0, rpc_retries=0, max_frames=64))

    async def on_score(msg, ctx):
        return Scores(scores=[])

    server.register(ScoreBatch, on_score, limits={"items": 100})
    with pytest.raises(ValueError, match="declares no limit for"):
        server.register(GetBufferStats, on_score, limits={"items": 1})
    address = await server.start()
    raw = await _raw_dealer(address)
    try:
        async def ask(frames):
            await raw.send_multipart(frames)
            # the bound only catches a request left unanswered: a million frames take seconds
            # of CPU to pass through ZeroMQ, many more on a loaded machine (5 s ran out there)
            return msgpack.unpackb((await asyncio.wait_for(raw.recv_multipart(), BACKSTOP))[0])

        reply = await ask(score_batch_frames(1_000_000))
        assert (reply["id"], reply["error"]["code"]) == ("big", "too_large")
        assert ("more than the 100 this receiver takes (reward.max_batch)"
                in reply["error"]["message"])
        reply = await ask([nested(64)])
        assert (reply["id"], reply["error"]["code"]) == ("deep", "too_large")
        # a million frames: the ones past the limit are discarded unread
        reply = await ask([msgpack.packb({"v": 1, "type": "heartbeat", "id": "many",
                                          "body": {"name": "x"}}), *[b""] * 1_000_000])
        assert (reply["id"], reply["error"]["code"]) == ("many", "too_large")
        assert "exceeds the limit of 64 frames (transport.max_frames)" in reply["error"]["message"]
        # garbage after a readable id is still answered, not silently dropped
        reply = await ask([b"\x84\xa1v\x01\xa2id\xa3bad\xa4type\xa9heartbeat\xa4body\xdd\xff"])
        assert (reply["id"], reply["error"]["code"]) == ("bad", "bad_request")
        reply = await ask(score_batch_frames(100, "fits"))
        assert reply["ok"] is True and reply["id"] == "fits"
    finally:
        raw.close(linger=0)
        await server.close()


async def test_refusals_are_logged_at_most_once_a_second(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="svc", transport=PATIENT)
    address = await server.start()
    raw = await _raw_dealer(address)
    client = RpcClient(address, peer="svc", transport=PATIENT)
    try:
        with capture_logs() as logs:
            began = time.monotonic()
            for _ in range(500):
                await raw.send_multipart([b"\xc1garbage"])
            assert isinstance(await client.call(Heartbeat(name="t")), HeartbeatAck)
            took = time.monotonic() - began
        assert server.dropped == 500
        drops = [e for e in logs if e["event"] == "rpc.dropped"]
        assert 1 <= len(drops) <= 1 + took  # one line, then at most one a second
    finally:
        raw.close(linger=0)
        await client.close()
        await server.close()


async def test_reply_cache_and_peer_table_are_bounded(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="svc", transport=PATIENT,
                       reply_cache_bytes=1 << 20)
    server.LAST_SEEN = 8

    @server.handler(Heartbeat)
    async def on_heartbeat(msg, ctx):
        return HeartbeatAck(name="x" * 200_000)

    address = await server.start()
    try:
        for k in range(20):
            async with RpcClient(address, peer="svc", transport=PATIENT, name=f"c{k}") as client:
                await client.call(Heartbeat(name="t"))
        assert len(server.last_seen) == 8
        assert server._reply_bytes <= 1 << 20 and len(server._replies) == 5
    finally:
        await server.close()


SERVER = textwrap.dedent("""
    import asyncio, sys
    from tandem.common.rpc import RpcServer
    from tandem.common.config import TransportConfig

    async def main():
        server = RpcServer("tcp://127.0.0.1:0", name="flooded", transport=TransportConfig())
        print(await server.start(), file=sys.stderr, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.close()

    asyncio.run(main())
""")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_flood_of_malformed_messages_leaves_the_server_no_larger():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(proc.stderr.readline().strip())
        heartbeat = msgpack.packb({"v": 1, "type": "heartbeat", "id": "hb", "body": {"name": "x"}})
        sock.send_multipart([heartbeat])
        assert sock.poll(int(BACKSTOP * 1000)) and sock.recv_multipart()
        before = rss_kib(proc.pid)
        many = [heartbeat, *[b"x" * 48] * 500]
        for k in range(3000):
            sock.send_multipart(many if k % 2 else [nested(3000 + k % 7, f"d{k}")])
            while sock.poll(0):
                sock.recv_multipart()
        sock.send_multipart([heartbeat])
        deadline = time.monotonic() + BACKSTOP
        while time.monotonic() < deadline:  # the flood is served when the heartbeat is
            if sock.poll(1000) and b"heartbeat.ack" in sock.recv_multipart()[0]:
                break
        # the heap is trimmed in the server's own loop a second after its last refusal: read
        # the growth once it is under the bound (a leak fails at the backstop)
        deadline = time.monotonic() + BACKSTOP
        while (growth := rss_kib(proc.pid) - before) >= 16 * 1024 and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        # 46 MB when every frame of a message became an object and every refusal a log line
        assert growth < 16 * 1024, f"RSS grew by {growth / 1024:.0f} MB"
    finally:
        sock.close(linger=0)
        ctx.term()
        proc.stdin.close()
        proc.wait(BACKSTOP)
