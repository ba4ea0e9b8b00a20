"""PUB/SUB with per-topic sequence numbers, gap detection and snapshots for late joiners.

An event is frames [topic, header, arrays...]; the header carries the topic's sequence number.
The publisher remembers the newest event of each topic and answers `SnapshotRequest` on an
RPC server, so a subscriber that joins late, or sees a gap, or has heard nothing for a while,
asks for the current state instead of waiting for the next event.
"""

from __future__ import annotations

import bisect
import time
import uuid
from collections import deque
from dataclasses import dataclass

import structlog
import zmq

from . import codec
from .config.transport import TransportConfig
from .errors import PeerDead, ProtocolError, RequestFailed, WaitTimeout
from .messages.base import Message, SnapshotEntry, SnapshotReply, SnapshotRequest
from .sockets import SocketFactory

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Event:
    """One published message as a subscriber receives it."""

    topic: str
    seq: int
    body: Message


class Publisher:
    """PUB socket that numbers each topic's events and keeps the newest one per topic."""

    def __init__(self, address: str, *, name: str, transport: TransportConfig | None = None,
                 factory: SocketFactory | None = None):
        self.address = address
        self.name = name
        self.factory = factory or SocketFactory(transport)
        self._sock = None
        self.bound: str | None = None
        self._seq: dict[str, int] = {}
        # topic -> (seq, message, publish order): a snapshot replays in the order published
        self._latest: dict[str, tuple[int, Message, int]] = {}
        # the topics of `_latest`, sorted, so the topics under a prefix are one range: every
        # waiting subscriber asks for a snapshot each second, and a scan of all topics per ask
        # made a master's idle work grow with the square of its explorers (tools/bench_scale.py)
        self._topics: list[str] = []
        self._published = 0

    async def start(self) -> str:
        if self.bound is None:
            self._sock, self.bound = self.factory.pub(self.address)
        return self.bound

    def continue_sequences(self, last: dict[str, int]) -> None:
        """After a restart: number each topic's next event after `last[topic]`, so subscribers
        see a continuation instead of a restart (and drop nothing as already seen)."""
        for topic, seq in last.items():
            self._seq[topic] = max(self._seq.get(topic, 0), seq)

    async def publish(self, topic: str, msg: Message) -> int:
        """Send `msg` on `topic`; returns its sequence number."""
        seq = self._seq.get(topic, 0) + 1
        self._seq[topic] = seq
        self._published += 1
        if topic not in self._latest:
            bisect.insort(self._topics, topic)
        self._latest[topic] = (seq, msg, self._published)
        frames = codec.encode_event(msg, uuid.uuid4().hex, seq,
                                    inline_threshold=self.factory.transport.inline_threshold)
        await self._sock.send_multipart([topic.encode(), *frames], copy=False)
        return seq

    def withdraw(self, topic: str) -> None:
        """`topic`'s newest event no longer stands (a grant taken back): snapshots leave it out
        until the next one is published."""
        if self._latest.pop(topic, None) is not None:
            self._topics.pop(bisect.bisect_left(self._topics, topic))

    def snapshot(self, prefixes: list[str] | None = None) -> list[SnapshotEntry]:
        """The newest event of every topic matching one of `prefixes` (all when empty), in the
        order they were published: a late joiner acts on them as a live subscriber would have
        (the weights group announced before the barrier that loads from it)."""
        topics: set[str] | dict = set() if prefixes else self._latest
        for prefix in prefixes or ():
            i = bisect.bisect_left(self._topics, prefix)
            while i < len(self._topics) and self._topics[i].startswith(prefix):
                topics.add(self._topics[i])
                i += 1
        return [
            SnapshotEntry(topic=topic, seq=seq, type=msg.TYPE,
                          body=msg.model_dump(mode="python", round_trip=True))
            for topic, (seq, msg, _) in sorted(((t, self._latest[t]) for t in topics),
                                               key=lambda kv: kv[1][2])
        ]

    def serve_snapshots(self, server) -> None:
        """Answer `SnapshotRequest` on RPC server `server`."""

        async def on_snapshot(msg: SnapshotRequest, ctx) -> SnapshotReply:
            return SnapshotReply(entries=self.snapshot(msg.topics))

        server.register(SnapshotRequest, on_snapshot)

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class Subscriber:
    """SUB socket; `recv(timeout)` returns events in order, skipping those already seen.

    With a `snapshot` RPC client (to the publisher's server) it fetches the current state on
    start, after a gap, and every `resync_interval` seconds of silence while waiting.
    """

    def __init__(self, address: str, *, topics: list[str], transport: TransportConfig | None = None,
                 factory: SocketFactory | None = None, snapshot=None,
                 resync_interval: float = 1.0):
        self.address = address
        self.topics = list(topics)
        self.factory = factory or SocketFactory(transport)
        self.snapshot_client = snapshot
        self.resync_interval = resync_interval
        self._sock = None
        self._queue: deque[Event] = deque()
        self._limits = codec.Limits.of(self.factory.transport)
        self.last_seq: dict[str, int] = {}
        self.gaps = 0
        self.dropped = 0

    async def start(self) -> None:
        if self._sock is None:
            self._sock = self.factory.sub(self.address, self.topics)
            await self.resync()

    async def resync(self) -> None:
        """Fetch the publisher's newest event per topic; queue those not yet seen."""
        if self.snapshot_client is None:
            return
        try:
            reply = await self.snapshot_client.call(SnapshotRequest(topics=self.topics),
                                                    timeout=self.resync_interval * 2, retries=0)
        except (PeerDead, RequestFailed) as exc:
            log.debug("pubsub.snapshot_failed", error=str(exc))
            return
        for entry in reply.entries:
            if entry.seq <= self.last_seq.get(entry.topic, 0):
                continue
            try:
                body = codec.validate_body(entry.type, entry.body)
            except ProtocolError as exc:
                self.dropped += 1
                log.warning("pubsub.bad_snapshot_entry", topic=entry.topic, error=str(exc))
                continue
            self.last_seq[entry.topic] = entry.seq
            self._queue.append(Event(entry.topic, entry.seq, body))

    def _take(self, frames: list) -> Event | None:
        try:
            topic = frames[0].bytes.decode()
            env = codec.decode(frames[1:], limits=self._limits)
        except Exception as exc:
            self.dropped += 1
            log.warning("pubsub.dropped", error=str(exc), dropped=self.dropped)
            return None
        seq = env.seq or 0
        last = self.last_seq.get(topic)
        if last is not None and seq <= last:
            return None  # already delivered (from a snapshot)
        if last is not None and seq > last + 1:
            self.gaps += 1
            log.info("pubsub.gap", topic=topic, expected=last + 1, got=seq)
        self.last_seq[topic] = seq
        return Event(topic, seq, env.body)

    async def recv(self, timeout: float, *, what: str = "event",
                   timeout_key: str = "sync.timeout") -> Event:
        """The next event; `WaitTimeout` naming `what` and `timeout_key` after `timeout` s."""
        await self.start()
        deadline = time.monotonic() + timeout
        while True:
            if self._queue:
                return self._queue.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"no {what} from {self.address} within {timeout:g}s; "
                                  f"raise {timeout_key} if the publisher is only slow")
            wait = min(remaining, self.resync_interval) if self.snapshot_client else remaining
            if await self._sock.poll(timeout=wait * 1000, flags=zmq.POLLIN):
                frames = await self._sock.recv_multipart(copy=False)
                event = self._take(frames)
                if event is not None:
                    return event
            elif self.snapshot_client is not None:
                await self.resync()

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
