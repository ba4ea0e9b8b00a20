"""`Buffer`: the experience store served over RPC (put, sample, ack, release, rewind, stats).

Embedded: `await Buffer(config).serve()` in any event loop, `request_stop()` from a signal
handler or another task, then `close()`: the caller closes. The CLI (`tandem-buffer`) is one
caller of it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from pathlib import Path

import numpy as np
import structlog

from tandem.common.config import RunConfig
from tandem.common.errors import RequestFailed
from tandem.common.metrics import MetricsEndpoint
from tandem.common.messages import (
    AckLease, BufferStats, CheckpointSaved, GetBufferStats, LeasesReleased, Ok, PutExperiences,
    PutResult, ReleaseLease, ReleaseLeases, RewindTo, Rewound, SampleGroups, SampleResult,
)
from tandem.common.rpc import CallContext, Handler, RpcServer
from tandem.common.trace import Tracer

from .sqlite import SqliteStore
from .store import (
    BadPut, BufferFull, ExperienceStore, NotEnoughExperiences, RewindTooFar, StoreError,
    UnknownLease,
)

log = structlog.get_logger(__name__)

REPLY_MARGIN = 0.05  # seconds kept from a sampler's deadline so the "not enough" reply arrives
RECHECK = 0.5  # seconds between re-checks while a sample waits (lease expiry frees groups too)
FILL_EVERY = 0.5  # seconds between buffer_fill trace events
METRICS_EVERY = 2.0  # seconds between refreshes of the store's counts for /metrics

# The reply code of each store error; RpcServer sends RequestFailed as (code, message).
REPLY_CODES: dict[type[StoreError], str] = {
    BufferFull: "full",
    NotEnoughExperiences: "not_enough",
    UnknownLease: "unknown_lease",
    BadPut: "bad_request",
    RewindTooFar: "rewind_too_far",
}


def _replying(handler: Handler) -> Handler:
    """The handler with store errors turned into the reply codes of REPLY_CODES."""

    @functools.wraps(handler)
    async def answer(msg, ctx: CallContext):
        try:
            return await handler(msg, ctx)
        except StoreError as exc:
            code = next((REPLY_CODES[t] for t in type(exc).__mro__ if t in REPLY_CODES),
                        type(exc).__name__)
            raise RequestFailed(code, str(exc),
                                retry_after=getattr(exc, "retry_after", None)) from None

    return answer


class _Parked:
    """A sample request waiting for groups: woken by every change, or told why it must end."""

    __slots__ = ("holder", "superseded", "wake")

    def __init__(self, holder: str | None) -> None:
        self.wake = asyncio.Event()
        self.holder = holder
        self.superseded: str | None = None

    def supersede(self, why: str) -> None:
        if self.superseded is None:
            self.superseded = why
            self.wake.set()


class Buffer:
    """The buffer component: an `ExperienceStore` (SQLite by default) behind an RpcServer."""

    def __init__(self, config: RunConfig, *, address: str | None = None,
                 store: ExperienceStore | None = None):
        self.config = config
        self.address = address or config.buffer.address
        self.run_dir = Path(config.run_dir)
        self.store = store
        self.server = RpcServer(self.address, name="buffer", transport=config.transport)
        for msg_type, handler in ((PutExperiences, self.on_put), (SampleGroups, self.on_sample),
                                  (AckLease, self.on_ack), (ReleaseLease, self.on_release),
                                  (ReleaseLeases, self.on_release_leases),
                                  (RewindTo, self.on_rewind), (CheckpointSaved, self.on_checkpoint),
                                  (GetBufferStats, self.on_stats)):
            self.server.register(msg_type, _replying(handler))
        self.tracer = Tracer(self.run_dir if config.logging.trace else None, "buffer")
        self._repeat_times = {e.name: e.repeat_times for e in config.explorers}
        distinct = set(self._repeat_times.values())
        self._shared_repeat = distinct.pop() if len(distinct) == 1 else None
        self._parked: dict[str, deque[_Parked]] = {}  # waiting samples, per client
        self._stop = asyncio.Event()
        self._last_fill = 0.0
        self._background: set[asyncio.Task] = set()
        self.bound: str | None = None
        self.metrics = MetricsEndpoint(config.logging.metrics, "buffer", run_dir=self.run_dir)
        m = self.metrics
        self._m_puts = m.counter("put_experiences", "experiences stored by puts",
                                 labels=("outcome",))
        self._m_samples = m.counter("samples", "leases handed out by samples")
        self._m_sampled_groups = m.counter("sampled_groups", "groups handed out by samples")
        self._m_acks = m.counter("acks", "leases acknowledged (their groups consumed)")
        self._m_releases = m.counter("releases", "leases released unconsumed")
        self._m_state = m.gauge("experiences", "experiences in the store, by state",
                                labels=("state",))
        self._m_groups_ready = m.gauge("groups_ready", "complete groups ready to sample")
        self._m_leases = m.gauge("leases", "leases outstanding")
        m.gauge_fn("leases_expired", "leases that expired (their holder never acked)",
                   lambda: getattr(self.store, "leases_expired", 0))
        m.rpc_errors(self.server)

    async def start(self) -> str:
        """Open the store and bind; returns the bound address (port 0 resolved)."""
        if self.bound is not None:
            return self.bound
        if self.store is None:
            self.store = await asyncio.to_thread(
                SqliteStore.from_config, self.config.buffer, self.run_dir)
        self.bound = await self.server.start()
        if self.metrics.start() is not None:
            self._spawn(self._refresh_metrics())
        stats = await self.store.stats()
        log.info("buffer.listening", address=self.bound,
                 db=str(self.run_dir / self.config.buffer.db), ready_groups=stats.groups_ready,
                 unconsumed=stats.by_state["waiting"] + stats.by_state["ready"]
                 + stats.by_state["leased"])
        return self.bound

    async def serve(self) -> None:
        """Serve until `request_stop()` (or `close()`); the caller then calls `close()`."""
        await self.start()
        await self._stop.wait()

    def request_stop(self) -> None:
        """Ask `serve()` to return; safe from a signal handler."""
        self._stop.set()

    async def close(self) -> None:
        """Stop answering, let the store commit what it has queued, close everything."""
        self.request_stop()
        self.tracer.flush()  # before a teardown that a supervisor may cut short
        await self.server.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.store is not None:
            await self.store.close()
        self.metrics.close()
        self.tracer.close()
        log.info("buffer.stopped", address=self.bound)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_metrics(self) -> None:
        """The store's counts for /metrics, every METRICS_EVERY seconds (a scrape runs in the
        endpoint's thread and cannot query the store itself)."""
        while True:
            try:
                stats = await self.store.stats()
            except Exception as exc:  # a busy store: the next refresh catches up
                log.warning("buffer.metrics_refresh_failed", error=f"{type(exc).__name__}: {exc}")
            else:
                for state, count in stats.by_state.items():
                    self._m_state.labels(state).set(count)
                self._m_groups_ready.set(stats.groups_ready)
                self._m_leases.set(stats.leases)
            await asyncio.sleep(METRICS_EVERY)

    # ---- handlers -------------------------------------------------------------------------

    def _group_sizes(self, msg: PutExperiences) -> list[int]:
        if msg.group_size is not None:
            return [msg.group_size] * len(msg.experiences)
        sizes = []
        for exp in msg.experiences:
            size = self._repeat_times.get(exp.explorer, self._shared_repeat)
            if size is None:
                raise BadPut(
                    f"experience {exp.id}: cannot tell its group size: explorer {exp.explorer!r} "
                    f"is not in the config's explorers and their repeat_times differ "
                    f"({self._repeat_times}); send group_size with buffer.put")
            sizes.append(size)
        return sizes

    def _notify(self) -> None:
        for parked in self._parked.values():
            for waiter in parked:
                waiter.wake.set()

    def _park(self, peer: str, holder: str | None) -> _Parked:
        """Count a waiting sample against its client; past buffer.max_parked_per_client the
        client's oldest waiting sample is answered now (a flood or a re-send holds no more)."""
        parked = self._parked.setdefault(peer, deque())
        while len(parked) >= self.config.buffer.max_parked_per_client:
            parked.popleft().supersede("superseded by a newer sample from the same client "
                                       "(buffer.max_parked_per_client)")
        waiter = _Parked(holder)
        parked.append(waiter)
        return waiter

    def _supersede_holder(self, holder: str | None, why: str) -> None:
        """End the waiting samples of `holder` (of everyone when None): they come from an
        incarnation that is gone, and must not lease groups its successor is about to train."""
        for parked in self._parked.values():
            for waiter in parked:
                if holder is None or waiter.holder == holder:
                    waiter.supersede(why)

    def _unpark(self, peer: str, waiter: _Parked) -> None:
        parked = self._parked.get(peer)
        if parked is None:
            return
        if waiter in parked:
            parked.remove(waiter)
        if not parked:
            del self._parked[peer]

    async def on_put(self, msg: PutExperiences, ctx: CallContext) -> PutResult:
        outcome = await self.store.put(msg.experiences, self._group_sizes(msg),
                                       {k: v.tobytes() for k, v in msg.images.items()})
        self._m_puts.labels("stored").inc(outcome.stored)
        self._m_puts.labels("duplicate").inc(outcome.duplicates)
        self._m_puts.labels("dropped_stale").inc(outcome.dropped_stale)
        if outcome.stored:
            self._notify()
            self._trace_fill(throttle=True)
        log.debug("buffer.put", peer=ctx.peer, stored=outcome.stored,
                  duplicates=outcome.duplicates, dropped_stale=outcome.dropped_stale)
        return PutResult(stored=outcome.stored, duplicates=outcome.duplicates,
                         dropped_stale=outcome.dropped_stale)

    def _trace_fill(self, *, throttle: bool = False) -> None:
        """Record the ready-group count for the timeline: after every sample or release (the
        level drops), and at most every FILL_EVERY seconds on puts (they come in bursts)."""
        now = time.time()
        if not self.tracer.enabled or (throttle and now - self._last_fill < FILL_EVERY):
            return
        self._last_fill = now

        async def record() -> None:
            self.tracer.event("buffer_fill", ready=await self.store.ready_groups())

        task = asyncio.create_task(record())  # off the reply path
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def on_sample(self, msg: SampleGroups, ctx: CallContext) -> SampleResult:
        loop = asyncio.get_running_loop()
        wait = min(msg.wait, self.config.buffer.max_sample_wait,
                   max(0.0, ctx.remaining() - REPLY_MARGIN))
        deadline = loop.time() + wait
        started = time.time()
        dropped = waited = 0
        waiter = self._park(ctx.peer, msg.holder) if wait > 0 else None
        try:
            while True:
                if waiter is not None:
                    waiter.wake.clear()  # a change from now on wakes the wait below
                try:
                    lease = await self.store.sample(
                        msg.num_groups, policy=msg.policy, min_version=msg.min_version,
                        max_version=msg.max_version, lease_seconds=msg.lease_seconds,
                        holder=msg.holder, min_groups=msg.min_groups)
                    break
                except NotEnoughExperiences as exc:
                    dropped += exc.dropped
                    remaining = deadline - loop.time()
                    ended = waiter.superseded if waiter is not None else None
                    if remaining <= 0 or ended:
                        raise NotEnoughExperiences(
                            exc.have, exc.need, dropped, time.time() - started if waited else 0.0,
                            f"; {ended}" if ended else "") from None
                    waited += 1
                    try:
                        await asyncio.wait_for(waiter.wake.wait(), min(remaining, RECHECK))
                    except TimeoutError:
                        pass
                    if waiter.superseded:  # answer now, without leasing anything more
                        raise NotEnoughExperiences(
                            exc.have, exc.need, dropped, time.time() - started,
                            f"; {waiter.superseded}") from None
        finally:
            if waiter is not None:
                self._unpark(ctx.peer, waiter)
        self._m_samples.inc()
        self._m_sampled_groups.inc(len(lease.group_ids))
        if waited:
            self.tracer.record("wait", started, time.time(), what="sample", groups=msg.num_groups)
        self._trace_fill()
        log.debug("buffer.sample", peer=ctx.peer, lease=lease.lease_id, groups=len(lease.group_ids),
                  experiences=len(lease.experiences), dropped_stale=lease.dropped_stale + dropped)
        return SampleResult(lease_id=lease.lease_id, expires_at=lease.expires_at,
                            experiences=lease.experiences, group_ids=lease.group_ids,
                            dropped_stale=lease.dropped_stale + dropped,
                            images={k: np.frombuffer(v, dtype=np.uint8)
                                    for k, v in lease.images.items()})

    async def on_ack(self, msg: AckLease, ctx: CallContext) -> Ok:
        await self.store.ack(msg.lease_id, msg.step, msg.more)
        self._m_acks.inc()
        log.debug("buffer.ack", peer=ctx.peer, lease=msg.lease_id, step=msg.step)
        return Ok()

    async def on_release(self, msg: ReleaseLease, ctx: CallContext) -> Ok:
        await self.store.release(msg.lease_id)
        self._m_releases.inc()
        self._notify()
        self._trace_fill()
        log.debug("buffer.release", peer=ctx.peer, lease=msg.lease_id)
        return Ok()

    async def on_release_leases(self, msg: ReleaseLeases, ctx: CallContext) -> LeasesReleased:
        # first, so that a waiting sample of the holder's dead incarnation leases nothing more:
        # its store call already queued runs before the release below, and releases with it
        self._supersede_holder(msg.holder, f"its holder {msg.holder!r} released its leases "
                                           "(a restarted consumer took over)")
        leases = await self.store.release_holder(msg.holder)
        if leases:
            self._notify()
            self._trace_fill()
        log.info("buffer.holder_released", peer=ctx.peer, holder=msg.holder, leases=leases)
        return LeasesReleased(leases=leases)

    async def on_rewind(self, msg: RewindTo, ctx: CallContext) -> Rewound:
        self._supersede_holder(None, f"the buffer was rewound to step {msg.step}")
        outcome = await self.store.rewind(msg.step)
        if outcome.groups or outcome.leases_released:
            self._notify()
            self._trace_fill()
        log.info("buffer.rewind", peer=ctx.peer, step=msg.step, groups=outcome.groups,
                 uses=outcome.uses, leases_released=outcome.leases_released)
        return Rewound(groups=outcome.groups, uses=outcome.uses,
                       leases_released=outcome.leases_released)

    async def on_checkpoint(self, msg: CheckpointSaved, ctx: CallContext) -> Ok:
        await self.store.checkpointed(msg.step)
        log.debug("buffer.checkpoint", peer=ctx.peer, step=msg.step)
        return Ok()

    async def on_stats(self, msg: GetBufferStats, ctx: CallContext) -> BufferStats:
        return await self.store.stats()
