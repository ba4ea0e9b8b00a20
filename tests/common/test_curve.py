"""CurveZMQ: a client with an allowed key talks; one with an unknown key cannot."""

from __future__ import annotations

import pytest
import zmq.asyncio

from backstop import BACKSTOP
from tandem.common.auth import generate_keypair, stop_authenticators
from tandem.common.config import CurveConfig, TransportConfig
from tandem.common.errors import PeerDead
from tandem.common.messages import Heartbeat, HeartbeatAck
from tandem.common.rpc import RpcClient, RpcServer
from tandem.common.sockets import SocketFactory


async def test_only_allowed_client_keys_connect():
    server_pub, server_sec = generate_keypair()
    good_pub, good_sec = generate_keypair()
    bad_pub, bad_sec = generate_keypair()

    def transport(pub: str, sec: str) -> TransportConfig:
        return TransportConfig(rpc_timeout=0.5, rpc_retries=0, curve=CurveConfig(
            server_public=server_pub, server_secret=server_sec, client_public=pub,
            client_secret=sec, allowed_clients=[good_pub]))

    ctx = zmq.asyncio.Context()
    server = RpcServer("tcp://127.0.0.1:0", name="secure",
                       factory=SocketFactory(transport(good_pub, good_sec), ctx))
    address = await server.start()
    good = RpcClient(address, peer="secure", factory=SocketFactory(transport(good_pub, good_sec), ctx))
    bad = RpcClient(address, peer="secure", factory=SocketFactory(transport(bad_pub, bad_sec), ctx))
    try:
        assert isinstance(await good.call(Heartbeat(name="g"), timeout=BACKSTOP), HeartbeatAck)
        with pytest.raises(PeerDead):
            await bad.call(Heartbeat(name="b"))  # 0.5 s of silence: refused at the handshake
    finally:
        await good.close()
        await bad.close()
        await server.close()
        stop_authenticators()
        ctx.term()


def test_curve_keys_must_be_z85():
    from tandem.common.config import load_config
    from tandem.common.errors import ConfigError

    with pytest.raises(ConfigError, match="transport.curve.server_public must be a 40-character"):
        load_config(None, ["transport.curve.server_public=abc", "transport.curve.server_secret=x",
                           "transport.curve.client_public=y", "transport.curve.client_secret=z"])
