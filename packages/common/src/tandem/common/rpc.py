"""Request/reply over ZeroMQ: an asyncio ROUTER server and a pipelining DEALER client.

Every request carries an id (also its idempotency key) and a time-to-live. The server runs
one handler per message type, each request in its own task, and answers every request it can
attribute: a handler error becomes an error reply with a code, a malformed request a
`bad_request` reply; nothing a client sends can stop the server. A retried request (same id)
is answered once: while the first is in flight the retry is ignored, afterwards the cached
reply is sent again. The client resends on timeout with the same id and, when no answer
comes at all, raises `PeerDead` naming the peer and the config key that raises the limit.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import structlog
import zmq

from . import codec
from .config.transport import TransportConfig
from .errors import PeerDead, ProtocolError, RequestFailed, TandemError
from .messages.base import ErrorInfo, Heartbeat, HeartbeatAck, Message, Ok, Request
from .sockets import SocketFactory

log = structlog.get_logger(__name__)

Handler = Callable[[Any, "CallContext"], Awaitable[Message | None]]


@dataclass(slots=True)
class CallContext:
    """What a handler knows about the request it serves."""

    peer: str
    id: str
    type: str
    deadline: float  # time.monotonic() by which the caller stops waiting

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


async def _drain(sock):
    """Received messages: await one, then take whatever else is already queued without another
    trip through the event loop (a shadow socket's non-blocking recv), so a burst of pipelined
    requests costs one wake-up. Yields None after a receive error."""
    shadow = zmq.Socket.shadow(sock.underlying)
    while True:
        try:
            yield await sock.recv_multipart(copy=False)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            log.warning("rpc.recv_error", error=str(exc))
            yield None
            continue
        for _ in range(256):  # bounded, so one busy peer cannot starve the loop
            try:
                yield shadow.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break


class RpcServer:
    """ROUTER server: `register(MessageType, handler)`, `start()`, `serve()`, `close()`."""

    def __init__(self, address: str, *, name: str, transport: TransportConfig | None = None,
                 factory: SocketFactory | None = None, max_inflight: int = 4096,
                 reply_cache: int = 4096):
        self.address = address
        self.name = name
        self.factory = factory or SocketFactory(transport)
        self.transport = self.factory.transport
        self.max_inflight = max_inflight
        self._handlers: dict[type[Message], Handler] = {}
        self._sock = None
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._inflight: set[tuple[bytes, str]] = set()
        self._replies: OrderedDict[tuple[bytes, str], list] = OrderedDict()
        self._reply_cache = reply_cache
        self._closed = asyncio.Event()
        self.last_seen: dict[str, float] = {}
        self.dropped = 0
        self.bound: str | None = None
        self.register(Heartbeat, self._on_heartbeat)

    def register(self, msg_type: type[Request], handler: Handler) -> None:
        self._handlers[msg_type] = handler

    def handler(self, msg_type: type[Request]) -> Callable[[Handler], Handler]:
        def decorate(fn: Handler) -> Handler:
            self.register(msg_type, fn)
            return fn

        return decorate

    async def _on_heartbeat(self, msg: Heartbeat, ctx: CallContext) -> HeartbeatAck:
        return HeartbeatAck(name=self.name)

    async def start(self) -> str:
        if self.bound is None:
            self._sock, self.bound = self.factory.router(self.address)
            self._loop_task = asyncio.create_task(self._recv_loop(), name=f"rpc-{self.name}")
            log.debug("rpc.listening", server=self.name, address=self.bound)
        return self.bound

    async def serve(self) -> None:
        await self.start()
        await self._closed.wait()

    async def close(self) -> None:
        self._closed.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _recv_loop(self) -> None:
        sock = self._sock
        async for frames in _drain(sock):
            if frames is None:
                if self._closed.is_set():
                    return
                continue
            identity = frames[0].bytes
            self.last_seen[identity.decode(errors="replace")] = time.monotonic()
            self._accept(identity, frames[1:])

    def _accept(self, identity: bytes, frames: Sequence[Any]) -> None:
        try:
            header, _ = codec.decode_header(
                frames, max_message_bytes=self.transport.max_message_bytes)
            req_id = header["id"]
        except Exception as exc:
            self._reject(identity, frames, exc)
            return
        key = (identity, req_id)
        cached = self._replies.get(key)
        if cached is not None:
            self._send(identity, cached)
            return
        if key in self._inflight:
            return  # a retry of a request still being served: the first answer serves both
        try:
            env = codec.envelope_from_header(header)
        except Exception as exc:
            self._reject(identity, frames, exc, req_id)
            return
        if len(self._inflight) >= self.max_inflight:
            self._send(identity, codec.encode_reply(req_id, error=ErrorInfo(
                code="busy", message=f"{self.name} has {len(self._inflight)} requests in flight",
                retry_after=0.05)))
            return
        self._inflight.add(key)
        ttl = env.ttl if env.ttl is not None else self.transport.rpc_timeout
        ctx = CallContext(identity.decode(errors="replace"), req_id, env.type,
                          time.monotonic() + ttl)
        task = asyncio.create_task(self._serve_one(identity, key, env.body, ctx))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reject(self, identity: bytes, frames: Sequence[Any], exc: Exception,
                req_id: str | None = None) -> None:
        req_id = req_id or codec.peek_id(frames)
        reason = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
        if req_id is None:
            self.dropped += 1
            log.warning("rpc.dropped", server=self.name, peer=identity.decode(errors="replace"),
                        reason=reason, dropped=self.dropped)
            return
        self._send(identity, codec.encode_reply(
            req_id, error=ErrorInfo(code="bad_request", message=reason)))

    async def _serve_one(self, identity: bytes, key: tuple[bytes, str], body: Message,
                         ctx: CallContext) -> None:
        try:
            handler = self._handlers.get(type(body))
            if handler is None:
                raise RequestFailed("unsupported", f"{self.name} does not handle {body.TYPE!r}")
            result = await handler(body, ctx)
            frames = codec.encode_reply(ctx.id, result if result is not None else Ok(),
                                        inline_threshold=self.transport.inline_threshold)
        except asyncio.CancelledError:
            self._inflight.discard(key)
            raise
        except RequestFailed as exc:
            frames = codec.encode_reply(ctx.id, error=ErrorInfo(
                code=exc.code, message=exc.message, retry_after=exc.retry_after))
        except TandemError as exc:
            frames = codec.encode_reply(ctx.id, error=ErrorInfo(
                code=type(exc).__name__, message=str(exc)))
        except Exception as exc:
            log.exception("rpc.handler_failed", server=self.name, type=ctx.type)
            frames = codec.encode_reply(ctx.id, error=ErrorInfo(
                code="internal", message=f"{self.name} failed on {ctx.type}: "
                                         f"{type(exc).__name__}: {exc}"))
        self._inflight.discard(key)
        self._replies[key] = frames
        if len(self._replies) > self._reply_cache:
            self._replies.popitem(last=False)
        self._send(identity, frames)

    def _send(self, identity: bytes, frames: list) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will retry
            log.debug("rpc.reply_dropped", server=self.name, error=str(exc))


class RpcClient:
    """DEALER client with pipelined calls: `await client.call(msg, timeout=, retries=)`."""

    def __init__(self, address: str, *, peer: str, transport: TransportConfig | None = None,
                 factory: SocketFactory | None = None, name: str = "client"):
        self.address = address
        self.peer = peer
        self.factory = factory or SocketFactory(transport)
        self.transport = self.factory.transport
        self.name = name
        self._sock = None
        self._pending: dict[str, tuple[asyncio.Future, type[Message] | None]] = {}
        self._recv_task: asyncio.Task | None = None
        self.last_reply_at: float | None = None

    def _ensure(self) -> None:
        if self._sock is None:
            self._sock = self.factory.dealer(self.address, self.name)
            self._recv_task = asyncio.create_task(self._recv_loop(), name=f"rpc-client-{self.peer}")

    async def call(self, msg: Request, *, timeout: float | None = None, retries: int | None = None,
                   timeout_key: str = "transport.rpc_timeout") -> Message:
        """Send `msg`, return its reply; RequestFailed on an error reply, PeerDead on silence."""
        self._ensure()
        timeout = self.transport.rpc_timeout if timeout is None else timeout
        retries = self.transport.rpc_retries if retries is None else retries
        req_id = uuid.uuid4().hex
        frames = codec.encode_request(msg, req_id, ttl=timeout,
                                      inline_threshold=self.transport.inline_threshold)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[req_id] = (future, getattr(type(msg), "REPLY", None))
        try:
            for attempt in range(retries + 1):
                await self._sock.send_multipart(frames, copy=False)
                # asyncio.wait leaves the future alone on timeout (the next attempt waits on it
                # again) without the extra futures and callbacks of wait_for(shield(...))
                done, _ = await asyncio.wait((future,), timeout=timeout)
                if not done:
                    continue
                env = future.result()
                if env.ok:
                    return env.body
                err = env.error
                raise RequestFailed(err.code, err.message, retry_after=err.retry_after)
            raise PeerDead(self.peer, (
                f"{self.peer} at {self.address} did not answer {msg.TYPE} within {timeout:g}s "
                f"({retries + 1} attempts); is it running? If it is only slow, raise {timeout_key}"))
        finally:
            self._pending.pop(req_id, None)
            if not future.done():
                future.cancel()

    async def _recv_loop(self) -> None:
        async for frames in _drain(self._sock):
            if frames is None:
                return
            try:
                header, _ = codec.decode_header(
                    frames, max_message_bytes=self.transport.max_message_bytes)
            except Exception as exc:
                log.warning("rpc.bad_reply", peer=self.peer, error=str(exc))
                continue
            pending = self._pending.get(header["id"])
            if pending is None:
                continue  # the answer to a retry already answered, or to a call given up on
            future, reply_type = pending
            self.last_reply_at = time.monotonic()
            if future.done():
                continue
            try:
                future.set_result(codec.envelope_from_header(header, reply_type=reply_type))
            except Exception as exc:
                future.set_exception(exc if isinstance(exc, ProtocolError)
                                     else ProtocolError(f"reply from {self.peer}: {exc}"))

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
            self._recv_task = None
        for future, _ in self._pending.values():
            if not future.done():
                future.cancel()
        self._pending.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> "RpcClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
