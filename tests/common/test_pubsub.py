"""PUB/SUB: sequence numbers, late joiners get a snapshot, gaps are detected, waits time out."""

from __future__ import annotations

import asyncio
import time

import pytest

from backstop import BACKSTOP
from tandem.common.config import TransportConfig
from tandem.common.errors import WaitTimeout
from tandem.common.heartbeat import Heartbeater, Liveness
from tandem.common.messages import Barrier, Stop
from tandem.common.pubsub import Publisher, Subscriber
from tandem.common.rpc import RpcClient, RpcServer

T = TransportConfig(rpc_timeout=1.0, rpc_retries=0)


async def subscribed(pub: Publisher, sub: Subscriber) -> None:
    """Return once the subscriptions `sub` sends as it connects have reached `pub`, so that
    what is published from now on reaches it live. A PUB drops what no subscription matches:
    probes go out on a topic under `sub`'s last one (each withdrawn at once, so no snapshot
    holds it) until one arrives; the ones published after it are on their way and read too."""
    topic = f"{sub.topics[-1]}.probe"
    deadline = time.monotonic() + BACKSTOP
    while True:
        sent = await pub.publish(topic, Stop(reason="probe"))
        pub.withdraw(topic)
        try:
            await sub.recv(0.05)
            break
        except WaitTimeout:
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
    while sub.last_seq[topic] < sent:
        await sub.recv(BACKSTOP)


async def _master():
    server = RpcServer("tcp://127.0.0.1:0", name="master", transport=T)
    pub = Publisher("tcp://127.0.0.1:0", name="master", transport=T)
    address, pub_address = await server.start(), await pub.start()
    pub.serve_snapshots(server)
    return server, pub, address, pub_address


async def test_late_joiner_gets_current_state_then_live_events(zmq_sockets_closed):
    server, pub, address, pub_address = await _master()
    for step in range(3):
        await pub.publish("barrier.e0", Barrier(explorer="e0", step=step, version=0, wait=False))
    await pub.publish("barrier.e1", Barrier(explorer="e1", step=9, version=9, wait=True))
    client = RpcClient(address, peer="master", transport=T)
    sub = Subscriber(pub_address, topics=["barrier.e0", "stop"], transport=T, snapshot=client,
                     resync_interval=0.2)
    try:
        first = await sub.recv(BACKSTOP)
        assert (first.topic, first.seq, first.body.step) == ("barrier.e0", 3, 2)
        await subscribed(pub, sub)
        await pub.publish("stop", Stop(reason="done"))
        await pub.publish("barrier.e0", Barrier(explorer="e0", step=3, version=1, wait=True))
        got = [await sub.recv(BACKSTOP), await sub.recv(BACKSTOP)]
        assert [(e.topic, e.seq) for e in got] == [("stop", 1), ("barrier.e0", 4)]
        assert sub.gaps == 0
    finally:
        await sub.close()
        await client.close()
        await pub.close()
        await server.close()


async def test_gap_is_detected_and_wait_times_out_naming_the_knob(zmq_sockets_closed):
    server, pub, _address, pub_address = await _master()
    sub = Subscriber(pub_address, topics=["t"], transport=T)
    try:
        await sub.start()
        await subscribed(pub, sub)
        await pub.publish("t", Stop(reason="1"))
        assert (await sub.recv(BACKSTOP)).seq == 1
        pub._seq["t"] = 5  # as if events 2..5 were lost on the way
        await pub.publish("t", Stop(reason="6"))
        assert (await sub.recv(BACKSTOP)).seq == 6
        assert sub.gaps == 1
        with pytest.raises(WaitTimeout, match="no barrier .* within 0.2s; raise sync.timeout"):
            await sub.recv(0.2, what="barrier")
    finally:
        await sub.close()
        await pub.close()
        await server.close()


async def test_heartbeater_reports_dead_and_alive_again(zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="master", transport=T)
    address = await server.start()
    client = RpcClient(address, peer="master", transport=T)
    events: asyncio.Queue[str] = asyncio.Queue()
    # 1 s: longer than a live server takes to answer on a loaded machine, short to wait out
    hb = Heartbeater(client, name="e0", interval=0.05, liveness=1.0,
                     on_dead=lambda p: events.put_nowait(f"dead:{p}"),
                     on_alive=lambda p: events.put_nowait(f"alive:{p}"))
    try:
        hb.start()
        deadline = time.monotonic() + BACKSTOP
        while not any(k.startswith("client-") for k in server.last_seen):
            assert time.monotonic() < deadline, "no heartbeat reached the server"
            await asyncio.sleep(0.02)
        assert events.empty()
        await server.close()
        assert await asyncio.wait_for(events.get(), BACKSTOP) == "dead:master"
        server = RpcServer(address, name="master", transport=T)
        await server.start()
        assert await asyncio.wait_for(events.get(), BACKSTOP) == "alive:master"
        assert events.empty()
    finally:
        await hb.close()
        await client.close()
        await server.close()


def test_liveness_marks_silent_peers():
    live = Liveness(1.0)
    live.touch("a", now=0.0)
    live.touch("b", now=0.5)
    assert live.silent(now=1.2) == ["a"]
    live.touch("a", now=1.2)
    assert live.silent(now=1.6) == ["b"]


async def test_a_snapshot_replays_topics_in_the_order_they_were_published(zmq_sockets_closed):
    """A late joiner must see the weights group announced before the barrier that loads from
    it, as a live subscriber would (sorted by topic name, `barrier.*` came first)."""
    from tandem.common.messages import WeightsPublished

    server, pub, address, pub_address = await _master()
    await pub.publish("weights", WeightsPublished(version=3, method="checkpoint", path="/v3"))
    await pub.publish("barrier.e0", Barrier(explorer="e0", step=4, version=3, wait=True))
    client = RpcClient(address, peer="master", transport=T)
    sub = Subscriber(pub_address, topics=["barrier.e0", "weights"], transport=T, snapshot=client)
    try:
        got = [await sub.recv(BACKSTOP), await sub.recv(BACKSTOP)]
        assert [e.topic for e in got] == ["weights", "barrier.e0"]
    finally:
        await sub.close()
        await client.close()
        await pub.close()
        await server.close()


class _CountingTopic(str):
    """A topic name that counts how often a snapshot tests it against a prefix."""

    checks = 0

    def startswith(self, *args) -> bool:
        type(self).checks += 1
        return super().startswith(*args)


async def test_a_snapshot_looks_only_at_the_topics_it_asks_for(zmq_sockets_closed):
    """Every subscriber waiting for an event asks for a snapshot each second; one that tested
    every topic made the master's idle work grow as the square of its explorers (one barrier
    topic each; tools/bench_scale.py). Among 1000 topics, asking for two looks at those two."""
    pub = Publisher("tcp://127.0.0.1:0", name="master", transport=T)
    await pub.start()
    try:
        for i in range(1000):
            await pub.publish(_CountingTopic(f"barrier.e{i}."),
                              Barrier(explorer=f"e{i}", step=0, version=0, wait=False))
        await pub.publish(_CountingTopic("stop"), Stop(reason="done"))
        pub.withdraw("barrier.e500.")
        _CountingTopic.checks = 0
        entries = pub.snapshot(["barrier.e7.", "stop", "barrier.e500."])
        assert [e.topic for e in entries] == ["barrier.e7.", "stop"]
        assert _CountingTopic.checks <= 6  # at most the match and its neighbour per prefix
        # a prefix still matches every topic under it, in publish order
        assert [e.topic for e in pub.snapshot(["barrier.e99"])] == [
            "barrier.e99.", *(f"barrier.e99{k}." for k in range(10))]
        assert len(pub.snapshot()) == 1000
    finally:
        await pub.close()
