"""What a wait that ran out says: the wait it really made, the peer, and the key that raises it."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from backstop import BACKSTOP
from tandem.common.config import TransportConfig
from tandem.common.errors import PeerDead
from tandem.common.heartbeat import Heartbeater
from tandem.common.messages import GetBufferStats
from tandem.common.rpc import RpcClient
from tandem.common.sockets import free_port


def nobody() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def test_a_retried_call_states_its_whole_wait(zmq_sockets_closed):
    address = nobody()
    async with RpcClient(address, peer="buffer", transport=TransportConfig()) as client:
        with pytest.raises(PeerDead) as info:
            await client.call(GetBufferStats(), timeout=0.1, retries=2, timeout_key="x.timeout")
        # three attempts of 0.1 s waited 0.3 s in all, and the message says so
        assert (f"buffer at {address} did not answer buffer.stats within 0.3s (3 attempts of "
                f"0.1s)") in str(info.value)
        assert str(info.value).endswith("raise x.timeout")
        with pytest.raises(PeerDead, match=r"within 0.2s; is it running"):
            await client.call(GetBufferStats(), timeout=0.2, retries=0)


async def test_peer_dead_names_the_key_that_raises_the_liveness(zmq_sockets_closed):
    client = RpcClient(nobody(), peer="master", transport=TransportConfig())
    beat = Heartbeater(client, name="explorer-0", interval=0.05, liveness=0.1)
    with capture_logs() as logs:
        beat.start()
        deadline = time.monotonic() + BACKSTOP
        while beat.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await beat.close()
    await client.close()
    [dead] = [e for e in logs if e["event"] == "peer.dead"]
    assert dead["peer"] == "master" and "transport.liveness" in dead["hint"]
