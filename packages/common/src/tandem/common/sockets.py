"""The one socket factory: bind/connect, linger, high-water marks, identity, MAXMSGSIZE, Curve.

No other module calls `ctx.socket(...)`. `tcp://host:0` binds to a free port and the factory
returns the real address.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import random
import socket
import time
import uuid

import zmq
import zmq.asyncio

from .config.transport import CurveConfig, TransportConfig
from .errors import BindFailed


def install_uvloop() -> bool:
    """Use uvloop's event loop policy when it is installed; returns whether it is in use."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


_handed_out: set[int] = set()

# Where `free_port` looks: registered ports below the usual ephemeral range (32768-60999), less
# the fixed ones a run uses itself (torchrun's 29500, the nccl rendezvous 29400, the default
# component and /metrics ports).
PORT_POOL = range(10000, 32768)
FIXED_PORTS = (range(29400, 29600), range(9400, 9500), range(5550, 5600))


def ephemeral_ports() -> range:
    """The kernel's range for `bind(0)` and the local end of `connect()` (Linux's
    ip_local_port_range; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


@functools.cache
def _port_pool() -> tuple[int, ...]:
    ephemeral = ephemeral_ports()
    return tuple(port for port in PORT_POOL if port not in ephemeral
                 and not any(port in fixed for fixed in FIXED_PORTS))


def _bindable(address: tuple[str, int]) -> int:
    """The port bound at `address` (released again at once), 0 if it is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(address)
        except OSError:
            return 0  # another listener, or a connection's local end
        return sock.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to now, for an address given to another process to bind.

    Outside the kernel's ephemeral range: a port from `bind(0)` was one of those, and in the
    seconds before its process bound it (a start-up's imports) it could become the local port
    of any socket opened meanwhile, a /metrics endpoint on port 0 or an srun's, and the server
    then failed to bind and took its run down. Outside the range only an explicit bind takes it.
    Never the same one twice in this process, and never a port a run fixes for itself."""
    pool = _port_pool()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(pool) if pool else 0
        if port in _handed_out:
            continue
        # free on every address (a server may bind 0.0.0.0), and on `host` itself
        port = _bindable(("0.0.0.0", port)) and _bindable((host, port))
        if port and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free TCP port on {host} that this process has not handed out already")


def new_identity(name: str) -> bytes:
    """A unique routing identity that still says who the peer is."""
    return f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}".encode()


class SocketFactory:
    """Creates every socket of a process with the transport settings applied."""

    def __init__(self, transport: TransportConfig | None = None,
                 context: zmq.asyncio.Context | None = None):
        self.transport = transport or TransportConfig()
        self.context = context or zmq.asyncio.Context.instance()
        self._auth_started = False

    def _socket(self, kind: int, *, server: bool, identity: bytes | None = None) -> zmq.asyncio.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.transport.hwm)
        sock.setsockopt(zmq.RCVHWM, self.transport.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.transport.max_message_bytes)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        curve = self.transport.curve
        if curve is not None:
            self._apply_curve(sock, curve, server=server)
        return sock

    def _apply_curve(self, sock: zmq.Socket, curve: CurveConfig, *, server: bool) -> None:
        if server:
            from .auth import start_authenticator

            if not self._auth_started:
                start_authenticator(self.context, curve)
                self._auth_started = True
            sock.curve_secretkey = curve.server_secret.encode()
            sock.curve_publickey = curve.server_public.encode()
            sock.curve_server = True
        else:
            sock.curve_secretkey = curve.client_secret.encode()
            sock.curve_publickey = curve.client_public.encode()
            sock.curve_serverkey = curve.server_public.encode()

    @staticmethod
    def bind(sock: zmq.Socket, address: str, *, retry_for: float = 2.0) -> str:
        """Bind and return the real endpoint (port 0 resolved).

        A port closed a moment ago (a restarted server) may still be held while ZeroMQ's I/O
        thread finishes closing the old listener, so "address in use" is retried briefly. A
        socket that cannot bind is closed, not leaked.
        """
        deadline = time.monotonic() + retry_for
        while True:
            try:
                sock.bind(address)
                break
            except zmq.ZMQError as exc:
                if exc.errno == errno.EADDRINUSE and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                sock.close(linger=0)
                raise BindFailed(f"cannot bind {address}: {exc}") from None
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)

    def router(self, address: str) -> tuple[zmq.asyncio.Socket, str]:
        sock = self._socket(zmq.ROUTER, server=True)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        return sock, self.bind(sock, address)

    def dealer(self, address: str, name: str) -> zmq.asyncio.Socket:
        sock = self._socket(zmq.DEALER, server=False, identity=new_identity(name))
        sock.connect(address)
        return sock

    def pub(self, address: str) -> tuple[zmq.asyncio.Socket, str]:
        sock = self._socket(zmq.PUB, server=True)
        return sock, self.bind(sock, address)

    def sub(self, address: str, topics: list[str]) -> zmq.asyncio.Socket:
        sock = self._socket(zmq.SUB, server=False)
        for topic in topics or [""]:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sock.connect(address)
        return sock
