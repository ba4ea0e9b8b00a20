"""Request/reply over ZeroMQ: an asyncio ROUTER server and a pipelining DEALER client.

Every request carries an id (also its idempotency key) and a time-to-live. The server runs
one handler per message type, each request in its own task, and answers every request it can
attribute: a handler error becomes an error reply with a code, a malformed request a
`bad_request` reply, one over the limits (`codec.Limits`, checked before decoding) a
`too_large` reply; nothing a client sends can stop the server or make it keep memory: frames
past `transport.max_frames` are discarded unread, refusals are logged at most once a second,
the reply cache is bounded in count and bytes, and the heap freed by a burst of refused
messages is handed back to the operating system. A retried request (same id)
is answered once: while the first is in flight the retry is ignored, afterwards the cached
reply is sent again. The client resends on timeout with the same id and, when no answer
comes at all, raises `PeerDead` naming the peer and the config key that raises the limit.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Self
from collections.abc import Awaitable, Callable, Sequence

import structlog
import zmq

from . import codec
from .config.transport import TransportConfig
from .errors import PeerDead, ProtocolError, RequestFailed, TandemError
from .messages.base import ErrorInfo, Heartbeat, HeartbeatAck, Message, Ok, Request
from .sockets import SocketFactory

log = structlog.get_logger(__name__)

Handler = Callable[[Any, "CallContext"], Awaitable[Message | None]]


def peer_name(identity: bytes) -> str:
    """A routing identity as errors and logs show it: tandem's own identities are text
    (`explorer-0-4242-a1b2c3`, see `sockets.new_identity`) and stay as they are; any other
    (ZeroMQ's generated 5 bytes, a foreign client's) is `<0x...>` in hex. One-to-one, so it
    also serves as the peer's key: a text identity that starts with `<` is shown in hex too."""
    try:
        text = identity.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text and text.isprintable() and not text.startswith("<"):
        return text
    return f"<0x{identity.hex()}>"


@dataclass(slots=True)
class CallContext:
    """What a handler knows about the request it serves."""

    peer: str  # `peer_name` of the caller's routing identity
    id: str
    type: str
    deadline: float  # time.monotonic() by which the caller stops waiting

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def recv_bounded(sock: zmq.Socket, max_frames: int, scratch: bytearray) -> list:
    """One queued multipart message without blocking (`zmq.Again` when none), keeping at most
    `max_frames + 1` frames: the rest is read into `scratch` and dropped, so a message of a
    million frames costs no Python object per frame, and the decoder refuses it by its count."""
    frames = [sock.recv(zmq.NOBLOCK, copy=False)]
    while frames[-1].more:
        if len(frames) > max_frames:
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv_into(scratch, flags=zmq.NOBLOCK)
            break
        frames.append(sock.recv(zmq.NOBLOCK, copy=False))
    return frames


async def _drain(sock, max_frames: int):
    """Received messages: wait for one, then take whatever else is already queued without
    another trip through the event loop (a shadow socket's non-blocking recv), so a burst of
    pipelined requests costs one wake-up. Yields None after a receive error."""
    shadow = zmq.Socket.shadow(sock.underlying)
    scratch = bytearray(256)
    while True:
        try:
            await sock.poll(flags=zmq.POLLIN)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            log.warning("rpc.recv_error", error=str(exc))
            yield None
            continue
        for _ in range(256):  # bounded, so one busy peer cannot starve the loop
            try:
                frames = recv_bounded(shadow, max_frames, scratch)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                log.warning("rpc.recv_error", error=str(exc))
                yield None
                break
            yield frames


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


class _HeapTrim:
    """Hands heap memory freed after refused messages back to the operating system (glibc).

    Two things kept a component large after a flood of hostile messages. Frames of a few MB
    and up are allocated by ZeroMQ's I/O thread, and glibc raises its mmap threshold to the
    size of the first such block freed, so later ones came from the heap and stayed there when
    freed: a reward service kept 1.7 GB after refusing 19 MB requests. A fixed threshold
    (`mallopt(M_MMAP_THRESHOLD)`) keeps every block of 256 KiB and up in its own mapping,
    returned to the OS on free. Smaller blocks (frames, msgpack trees) stay in the arenas; a
    second after a burst of refusals `malloc_trim(0)` returns their free pages."""

    INTERVAL = 1.0
    MMAP_THRESHOLD = 256 << 10
    _libc = _glibc()
    _tuned = False

    def __init__(self) -> None:
        self.pending = False
        if self._libc is not None and not _HeapTrim._tuned:
            _HeapTrim._tuned = True
            self._libc.mallopt(-3, self.MMAP_THRESHOLD)  # M_MMAP_THRESHOLD

    def refused(self) -> None:
        if self._libc is not None and not self.pending:
            self.pending = True
            asyncio.get_running_loop().call_later(self.INTERVAL, self._trim)

    def _trim(self) -> None:
        self.pending = False
        self._libc.malloc_trim(0)


def _nbytes(frames: Sequence[Any]) -> int:
    return sum(len(f) if isinstance(f, bytes) else codec._buffer(f).nbytes for f in frames)


class RpcServer:
    """ROUTER server: `register(MessageType, handler)`, `start()`, `serve()`, `close()`."""

    LAST_SEEN = 4096  # peers remembered in `last_seen`, newest first out last

    def __init__(self, address: str, *, name: str, transport: TransportConfig | None = None,
                 factory: SocketFactory | None = None, max_inflight: int = 4096,
                 max_inflight_per_peer: int = 1024,
                 reply_cache: int = 4096, reply_cache_bytes: int = 64 << 20):
        self.address = address
        self.name = name
        self.factory = factory or SocketFactory(transport)
        self.transport = self.factory.transport
        self.max_inflight = max_inflight
        # one client's requests take at most this many of the max_inflight slots, so a client
        # that floods (or parks requests that wait long) cannot deny the others
        self.max_inflight_per_peer = min(max_inflight_per_peer, max_inflight)
        self._inflight_of: Counter[bytes] = Counter()
        self._handlers: dict[type[Message], Handler] = {}
        self._sock = None
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._inflight: set[tuple[bytes, str]] = set()
        self._replies: OrderedDict[tuple[bytes, str], tuple[list, int]] = OrderedDict()
        self._reply_cache = reply_cache
        self._reply_cache_bytes = reply_cache_bytes
        self._reply_bytes = 0
        self._closed = asyncio.Event()
        self.last_seen: OrderedDict[str, float] = OrderedDict()
        self.dropped = 0
        self.refused = 0
        self.errors_by_code: Counter[str] = Counter()  # error replies sent (Prometheus reads it)
        self._item_limits: dict[str, dict[str, tuple[int, str]]] = {}
        self.limits = codec.Limits.of(self.transport)
        self._heap = _HeapTrim()
        self._log_after = 0.0
        self._unlogged = 0
        self.bound: str | None = None
        self.register(Heartbeat, self._on_heartbeat)

    def register(self, msg_type: type[Request], handler: Handler, *,
                 limits: dict[str, int] | None = None) -> None:
        """Serve `msg_type` with `handler`. `limits` bounds the type's list fields declared in
        `msg_type.LIMITS` (e.g. `{"items": reward.max_batch}`); a request over them is refused
        from its raw array header, before anything is decoded."""
        self._handlers[msg_type] = handler
        if limits:
            declared = getattr(msg_type, "LIMITS", {})
            unknown = sorted(set(limits) - set(declared))
            if unknown:
                raise ValueError(f"{msg_type.__name__} declares no limit for {unknown}; "
                                 f"declared: {sorted(declared)}")
            self._item_limits[msg_type.TYPE] = {
                name: (most, declared[name]) for name, most in limits.items()}
            self.limits = codec.Limits.of(self.transport, self._item_limits)

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
        async for frames in _drain(sock, self.limits.max_frames + 1):
            if frames is None:
                if self._closed.is_set():
                    return
                continue
            identity = frames[0].bytes
            peer = peer_name(identity)
            self.last_seen[peer] = time.monotonic()
            self.last_seen.move_to_end(peer)
            if len(self.last_seen) > self.LAST_SEEN:
                self.last_seen.popitem(last=False)
            self._accept(identity, frames[1:])

    def _accept(self, identity: bytes, frames: Sequence[Any]) -> None:
        try:
            header, _ = codec.decode_header(frames, limits=self.limits)
            req_id = header["id"]
        except Exception as exc:
            self._reject(identity, frames, exc)
            return
        if header["type"] == "reply":
            self._reject(identity, frames, ProtocolError(
                f"{self.name} got a reply ({req_id}) where a request was expected; replies go "
                "from a server to its client, never to a server"), req_id)
            return
        key = (identity, req_id)
        cached = self._replies.get(key)
        if cached is not None:
            self._send(identity, cached[0])
            return
        if key in self._inflight:
            return  # a retry of a request still being served: the first answer serves both
        try:
            env = codec.envelope_from_header(header)
        except Exception as exc:
            self._reject(identity, frames, exc, req_id)
            return
        if len(self._inflight) >= self.max_inflight:
            self.errors_by_code["busy"] += 1
            self._send(identity, codec.encode_reply(req_id, error=ErrorInfo(
                code="busy", message=f"{self.name} has {len(self._inflight)} requests in flight",
                retry_after=0.05)))
            return
        if self._inflight_of[identity] >= self.max_inflight_per_peer:
            self.errors_by_code["busy"] += 1
            self._send(identity, codec.encode_reply(req_id, error=ErrorInfo(
                code="busy", message=f"{self.name} has {self._inflight_of[identity]} requests "
                                     "of this client in flight", retry_after=0.05)))
            return
        self._inflight.add(key)
        self._inflight_of[identity] += 1
        ttl = env.ttl if env.ttl is not None else self.transport.rpc_timeout
        ctx = CallContext(peer_name(identity), req_id, env.type,
                          time.monotonic() + ttl)
        task = asyncio.create_task(self._serve_one(identity, key, env.body, ctx))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reject(self, identity: bytes, frames: Sequence[Any], exc: Exception,
                req_id: str | None = None) -> None:
        req_id = req_id or (codec.peek_id(frames, self.limits) if frames else None)
        reason = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
        if len(reason) > 300:
            reason = reason[:297] + "..."
        self.refused += 1
        if req_id is None:
            self.dropped += 1
            self._log_refusal(identity, reason)
        else:
            code = "too_large" if isinstance(exc, codec.LimitExceeded) else "bad_request"
            self.errors_by_code[code] += 1
            self._send(identity, codec.encode_reply(
                req_id, error=ErrorInfo(code=code, message=reason)))
        self._heap.refused()

    def _log_refusal(self, identity: bytes, reason: str) -> None:
        """One warning a second at most: a flood of garbage must not become a flood of log."""
        now = time.monotonic()
        if now < self._log_after:
            self._unlogged += 1
            return
        log.warning("rpc.dropped", server=self.name, peer=peer_name(identity),
                    reason=reason, dropped=self.dropped, not_logged=self._unlogged)
        self._unlogged = 0
        self._log_after = now + 1.0

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
            self._done(key)
            raise
        except RequestFailed as exc:
            self.errors_by_code[exc.code] += 1
            frames = codec.encode_reply(ctx.id, error=ErrorInfo(
                code=exc.code, message=exc.message, retry_after=exc.retry_after))
        except TandemError as exc:
            self.errors_by_code[type(exc).__name__] += 1
            frames = codec.encode_reply(ctx.id, error=ErrorInfo(
                code=type(exc).__name__, message=str(exc)))
        except Exception as exc:
            log.exception("rpc.handler_failed", server=self.name, type=ctx.type)
            self.errors_by_code["internal"] += 1
            frames = codec.encode_reply(ctx.id, error=ErrorInfo(
                code="internal", message=f"{self.name} failed on {ctx.type}: "
                                         f"{type(exc).__name__}: {exc}"))
        self._done(key)
        size = _nbytes(frames)
        self._replies[key] = (frames, size)
        self._reply_bytes += size
        while self._replies and (len(self._replies) > self._reply_cache
                                 or self._reply_bytes > self._reply_cache_bytes):
            self._reply_bytes -= self._replies.popitem(last=False)[1][1]
        self._send(identity, frames)

    def _done(self, key: tuple[bytes, str]) -> None:
        if key in self._inflight:
            self._inflight.discard(key)
            self._inflight_of[key[0]] -= 1
            if not self._inflight_of[key[0]]:
                del self._inflight_of[key[0]]

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
        self.limits = codec.Limits.of(self.transport)
        self._pending: dict[str, tuple[asyncio.Future, type[Message] | None]] = {}
        self._recv_task: asyncio.Task | None = None
        self.last_reply_at: float | None = None
        self._stop_bound: tuple[float, str] | None = None  # (seconds, key) once stopping
        self._gone: PeerDead | None = None  # the peer left a call unanswered while stopping

    def bound_for_stop(self, seconds: float, key: str) -> None:
        """The caller is stopping (SIGTERM): from now on each call is one attempt (no resend)
        of at most `seconds` (`key` names the setting), and once the peer has left one
        unanswered, every later call fails at once with the same PeerDead. A peer that is
        stopping too, or already gone, then costs this bound once, not `rpc_retries + 1`
        times `rpc_timeout` per call. A live peer answers as before."""
        self._stop_bound = (seconds, key)

    def _ensure(self) -> None:
        if self._sock is None:
            self._sock = self.factory.dealer(self.address, self.name)
            self._recv_task = asyncio.create_task(self._recv_loop(), name=f"rpc-client-{self.peer}")

    async def call(self, msg: Request, *, timeout: float | None = None, retries: int | None = None,
                   timeout_key: str = "transport.rpc_timeout",
                   ttl: float | None = None, deadline: float | None = None,
                   deadline_key: str | None = None) -> Message:
        """Send `msg`, return its reply; RequestFailed on an error reply, PeerDead on silence.

        Each of the `retries` resends carries the same id, after `timeout` seconds of silence.
        `ttl` (default `timeout`) is the time the server may spend on it: a request resent so a
        restarted server gets it gives the whole wait, `timeout * (retries + 1)`.
        `deadline` (`time.monotonic()`) bounds the whole call, resends included: an attempt is
        cut short at it and none starts after it, so a caller that retries under a bound of its
        own (`deadline_key`: a put the buffer refuses as full, a sample asked again) never waits
        past that bound for one more call."""
        timeout = self.transport.rpc_timeout if timeout is None else timeout
        retries = self.transport.rpc_retries if retries is None else retries
        if self._stop_bound is not None:
            return await self._call_stopping(msg, timeout, timeout_key, ttl, deadline)
        return await self._attempts(msg, timeout, retries, timeout_key, ttl, deadline,
                                    deadline_key)

    async def _attempts(self, msg: Request, timeout: float, retries: int, timeout_key: str,
                        ttl: float | None, deadline: float | None,
                        deadline_key: str | None) -> Message:
        self._ensure()
        waited, cut = 0.0, False  # the silence this call was given, and whether `deadline` cut it
        req_id = uuid.uuid4().hex
        frames = codec.encode_request(msg, req_id, ttl=timeout if ttl is None else ttl,
                                      inline_threshold=self.transport.inline_threshold)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[req_id] = (future, getattr(type(msg), "REPLY", None))
        loop = asyncio.get_running_loop()
        try:
            for _ in range(retries + 1):
                limit = timeout
                if deadline is not None and deadline - time.monotonic() < timeout:
                    limit, cut = max(0.0, deadline - time.monotonic()), True
                    if limit <= 0.0:
                        break
                waited += limit
                began = loop.time()
                # a DEALER with no peer to take the message (none connected yet, or the
                # handshake failed: a port taken by another kind of socket) blocks its send for
                # ever; that wait is part of the attempt's silence. asyncio.wait, not wait_for:
                # Python 3.11's wait_for can swallow a cancellation that arrives as the send
                # completes, and a component closing its client would then wait for ever
                send = asyncio.ensure_future(self._sock.send_multipart(frames, copy=False))
                try:
                    sent, _ = await asyncio.wait((send,), timeout=limit)
                finally:
                    if not send.done():
                        send.cancel()
                if not sent:
                    continue
                send.result()  # a socket error is the caller's
                # asyncio.wait leaves the future alone on timeout (the next attempt waits on it
                # again) without the extra futures and callbacks of wait_for(shield(...))
                done, _ = await asyncio.wait(
                    (future,), timeout=max(0.0, limit - (loop.time() - began)))
                if not done:
                    continue
                env = future.result()
                if env.ok:
                    return env.body
                err = env.error
                raise RequestFailed(err.code, err.message, retry_after=err.retry_after)
            if cut and deadline_key is not None:
                raise PeerDead(self.peer, (
                    f"{self.peer} at {self.address} did not answer {msg.TYPE} within "
                    f"{round(waited, 3):g}s, when {deadline_key} ran out; is it running? If it is only "
                    f"slow, raise {deadline_key}"), bound=waited, key=deadline_key)
            tries = f" ({retries + 1} attempts of {timeout:g}s)" if retries else ""
            raise PeerDead(self.peer, (
                f"{self.peer} at {self.address} did not answer {msg.TYPE} within "
                f"{round(waited, 3):g}s{tries if not cut else ''}; is it running? If it is only slow, "
                f"raise {timeout_key}"), bound=waited, key=timeout_key)
        finally:
            self._pending.pop(req_id, None)
            if not future.done():
                future.cancel()

    async def _call_stopping(self, msg: Request, timeout: float, timeout_key: str,
                             ttl: float | None, deadline: float | None) -> Message:
        """`call` once the caller is stopping (`bound_for_stop`): one attempt, within the stop
        bound; logged, so a stop's calls and what each cost can be read back."""
        seconds, key = self._stop_bound
        if self._gone is not None:
            log.info("rpc.stopping_call", peer=self.peer, type=msg.TYPE, attempts=0,
                     outcome="peer_gone")
            raise self._gone
        bound = time.monotonic() + seconds
        deadline = bound if deadline is None else min(deadline, bound)
        began = time.monotonic()
        outcome = "answered"
        try:
            return await self._attempts(msg, timeout, 0, timeout_key, ttl, deadline, key)
        except PeerDead as exc:
            outcome = "no_answer"
            self._gone = exc
            raise
        except RequestFailed:
            outcome = "refused"
            raise
        finally:
            log.info("rpc.stopping_call", peer=self.peer, type=msg.TYPE, attempts=1,
                     bound=round(seconds, 3), seconds=round(time.monotonic() - began, 3),
                     outcome=outcome, key=key)

    async def _recv_loop(self) -> None:
        async for frames in _drain(self._sock, self.limits.max_frames):
            if frames is None:
                return
            try:
                header, _ = codec.decode_header(frames, limits=self.limits)
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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
