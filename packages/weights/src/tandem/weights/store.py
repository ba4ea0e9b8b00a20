"""The weight group's key-value store: a torch `Store` served over CurveZMQ to members only.

torch's `TCPStore` answers anyone who reaches its port (it lists, reads and writes every key),
so the group does not use it. The trainer's rank 0 keeps the keys in an in-process `HashStore`
and serves it on one ROUTER socket that is a Curve server: the store's keypair and one member
keypair are fresh per trainer process, and a ZAP handler admits only the member public key. The
member secret key reaches members only in the rendezvous the master relays (Curve-encrypted
when `transport.curve` is set) and is never written to disk (docs/reliability.md, "the weight
group's store"). A client without it fails the Curve handshake: it never gets a reply, so it
learns no key and changes none.

Members talk to it through `StoreClient`, a `torch.distributed.Store` that gloo and NCCL build
their process group on like any other store. A request is one msgpack array
`[op, key(s), args...]`, the reply `[ok, result]`; each travels behind a request-id frame so a
late reply to a request given up on is dropped.
"""

from __future__ import annotations

import datetime
import itertools
import os
import threading
import time
from typing import Any

import msgpack
import structlog
import torch.distributed as dist
import zmq

from tandem.common.auth import stop_authenticator
from tandem.common.config.transport import CurveConfig, TransportConfig
from tandem.common.sockets import SocketFactory

from .group import GroupAbandoned
from .tensors import WeightsError

log = structlog.get_logger(__name__)

MAX_REQUEST_BYTES = 256 * 2**20  # one store value: a BroadcastMeta of a very large model
_POLL_MS = 100  # how often the serving thread looks at its stop flag


class StoreUnreachable(WeightsError):
    """No reply from the group's store within the timeout (down, or this client is refused)."""


class StoreClosed(GroupAbandoned):
    """This member closed its store client (it is leaving): whatever waited on it stops."""


def _transport(store_public: str, store_secret: str, member_public: str,
               member_secret: str) -> TransportConfig:
    return TransportConfig(max_message_bytes=MAX_REQUEST_BYTES, curve=CurveConfig(
        server_public=store_public, server_secret=store_secret,
        client_public=member_public, client_secret=member_secret))


def _z85(key: bytes) -> str:
    return key.decode("ascii")


_contexts: dict[int, zmq.Context] = {}  # pid -> the context every StoreClient shares


def _clients_context() -> zmq.Context:
    """One blocking context for every StoreClient of this process (a fork gets its own); it is
    never terminated, so no client's collection can wait on it (see StoreClient)."""
    pid = os.getpid()
    if pid not in _contexts:
        _contexts[pid] = zmq.Context()
    return _contexts[pid]


class StoreServer:
    """Trainer rank 0's store: `store` (in-process) for the trainer, a Curve socket for members.

    `store_key` (public) and `member_secret` go into the rendezvous; nothing else admits a
    client. Serving runs on a daemon thread until `close()`."""

    def __init__(self, host: str, port: int = 0):
        store_public, store_secret = zmq.curve_keypair()
        member_public, member_secret = zmq.curve_keypair()
        self.store_key = _z85(store_public)
        self.member_secret = _z85(member_secret)
        self.store = dist.HashStore()
        self._context = zmq.Context()
        factory = SocketFactory(_transport(self.store_key, _z85(store_secret),
                                           _z85(member_public), self.member_secret),
                                context=self._context)
        try:
            self._socket, endpoint = factory.router(f"tcp://{host}:{port}")
        except Exception:
            stop_authenticator(self._context)  # the factory closed the socket it could not bind
            self._context.term()
            raise
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="tandem-weights-store")
        self._thread.start()

    def _serve(self) -> None:
        sock = self._socket
        try:
            while not self._closed.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                try:  # neither call may block, nor end the serving on a pipe that went
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    if len(frames) != 3:
                        continue  # not a StoreClient: nothing to answer
                    peer, request_id, payload = frames
                    sock.send_multipart([peer, request_id, self._answer(payload)], zmq.NOBLOCK)
                except zmq.Again:
                    continue  # the member's pipe went: it asks again or times out
        except zmq.ZMQError as exc:
            log.warning("weights.store.stopped", error=str(exc))
        finally:
            sock.close(linger=0)

    def _answer(self, payload: bytes) -> bytes:
        try:
            op, *args = msgpack.unpackb(payload, raw=False)
            result = _OPS[op](self.store, *args)
            return msgpack.packb([True, result])
        except Exception as exc:
            return msgpack.packb([False, f"{type(exc).__name__}: {exc}"])

    def close(self) -> None:
        """Stop serving (within a poll interval) and close the socket and its ZAP handler."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=10 * _POLL_MS / 1000)
        stop_authenticator(self._context)
        if self._thread.is_alive():  # stuck past its poll: close its socket from here
            self._context.destroy(linger=0)
        else:
            self._context.term()


def _get(store: dist.Store, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None  # never block the serving thread


def _compare_set(store: dist.Store, key: str, expected: bytes, desired: bytes) -> bytes:
    return store.compare_set(key, expected, desired)


_OPS = {
    "set": lambda store, key, value: store.set(key, value),
    "get": _get,
    "add": lambda store, key, amount: store.add(key, int(amount)),
    "check": lambda store, keys: store.check(list(keys)),
    "compare_set": _compare_set,
    "delete_key": lambda store, key: store.delete_key(key),
}


class StoreClient(dist.Store):
    """A member's view of the group's store, authenticated by the rendezvous' member secret.

    Thread-safe (one request at a time); `get` and `wait` poll until the key exists or the
    timeout runs out. Keep a reference to it for as long as a process group built on it lives:
    torch holds only the C++ half of a Python store."""

    def __init__(self, host: str, port: int, store_key: str, member_secret: str,
                 timeout: float):
        super().__init__()
        self._args = (host, port, store_key, member_secret)
        self.address = f"{host}:{port}"
        self._timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        member_public = _z85(zmq.curve_public(member_secret.encode("ascii")))
        # The process's one context, never this client's own: a client left to the garbage
        # collector (torch may drop its last reference in any order) took its own context
        # with it, and a context collected in the same cycle as its socket finds the socket
        # gone from its weak set, leaves it open and waits in term() forever (a whole test
        # process hung that way). A client's socket closes by itself; the context stays.
        factory = SocketFactory(_transport(store_key, member_secret, member_public,
                                           member_secret), context=_clients_context())
        self._socket = factory.dealer(f"tcp://{host}:{port}", "weights-member")
        self._clones: list[StoreClient] = []
        self._closed = False

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            request_id = str(next(self._ids)).encode()
            # A DEALER holds a request until the Curve handshake succeeds, which for a refused
            # key is never; both waits go in short slices so close() from another thread waits
            # for at most one.
            request = [request_id, msgpack.packb([op, *args])]
            while True:
                self._wait_for(zmq.POLLOUT, deadline, op, limit)
                try:
                    self._socket.send_multipart(request, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    # The pipe the poll saw went before the send: ZeroMQ's I/O thread tears
                    # it down when a handshake fails or the connection drops, and makes a
                    # new one on reconnecting. Not an error, only not writable yet.
                    time.sleep(_POLL_MS / 1000 / 10)
            while True:
                self._wait_for(zmq.POLLIN, deadline, op, limit)
                try:  # never a blocking recv: what the poll saw is read or waited for again
                    frames = self._socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                if len(frames) == 2 and frames[0] == request_id:
                    break  # anything else answers a request given up on
        ok, result = msgpack.unpackb(frames[1], raw=False)
        if not ok:
            raise WeightsError(f"weight group store at {self.address}: {op} failed: {result}")
        return result

    def _wait_for(self, event: int, deadline: float, op: str, limit: float) -> None:
        while True:
            self._check_open()
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnreachable(
                    f"weight group store at {self.address}: no answer to {op!r} within "
                    f"{limit:.1f} s (trainer gone, or this client's key is refused)")
            if self._socket.poll(int(min(left, _POLL_MS / 1000) * 1000) + 1, event):
                return

    def _poll_until(self, keys: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        pause = 0.001
        while not self._call("check", keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.02)
        return True

    # -- torch.distributed.Store --------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        if not self._poll_until([key], self._timeout):
            raise StoreUnreachable(f"weight group store at {self.address}: key {key!r} did not "
                                   f"appear within {self._timeout:.1f} s")
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        if not self._poll_until(list(keys), seconds):
            raise StoreUnreachable(f"weight group store at {self.address}: keys {list(keys)} "
                                   f"did not appear within {seconds:.1f} s")

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        as_bytes = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return self._call("compare_set", key, *as_bytes)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def clone(self) -> StoreClient:
        twin = StoreClient(*self._args, timeout=self._timeout)
        self._clones.append(twin)  # closed with this one
        return twin

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"weight group store client for {self.address} was closed")

    def close(self) -> None:
        """Close the socket (and any clone's); a request in another thread fails within
        a poll slice."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._socket.close(linger=0)
        for twin in self._clones:
            twin.close()
