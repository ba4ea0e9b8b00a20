"""`Buffer`: the experience store served over RPC (put, sample, ack, release, stats).

Embedded: `await Buffer(config).serve()` in any event loop, `stop()` from a signal handler or
another task, `close()` to finish. The CLI (`tandem-buffer`) is one caller of it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog

from tandem.common.config import RunConfig
from tandem.common.messages import (
    AckLease, BufferStats, GetBufferStats, Ok, PutExperiences, PutResult, ReleaseLease,
    SampleGroups, SampleResult,
)
from tandem.common.rpc import CallContext, RpcServer
from tandem.common.trace import Tracer

from .sqlite import SqliteStore
from .store import BadPut, ExperienceStore, NotEnoughExperiences

log = structlog.get_logger(__name__)

REPLY_MARGIN = 0.05  # seconds kept from a sampler's deadline so the "not enough" reply arrives
RECHECK = 0.5  # seconds between re-checks while a sample waits (lease expiry frees groups too)
FILL_EVERY = 0.5  # seconds between buffer_fill trace events


class Buffer:
    """The buffer component: an `ExperienceStore` (SQLite by default) behind an RpcServer."""

    def __init__(self, config: RunConfig, *, address: str | None = None,
                 store: ExperienceStore | None = None):
        self.config = config
        self.address = address or config.buffer.address
        self.run_dir = Path(config.run_dir)
        self.store = store
        self.server = RpcServer(self.address, name="buffer", transport=config.transport)
        self.server.register(PutExperiences, self.on_put)
        self.server.register(SampleGroups, self.on_sample)
        self.server.register(AckLease, self.on_ack)
        self.server.register(ReleaseLease, self.on_release)
        self.server.register(GetBufferStats, self.on_stats)
        self.tracer = Tracer(self.run_dir if config.logging.trace else None, "buffer")
        self._repeat_times = {e.name: e.repeat_times for e in config.explorers}
        distinct = set(self._repeat_times.values())
        self._shared_repeat = distinct.pop() if len(distinct) == 1 else None
        self._changed = asyncio.Event()  # replaced by a fresh one at every change
        self._stop = asyncio.Event()
        self._last_fill = 0.0
        self._background: set[asyncio.Task] = set()
        self.bound: str | None = None

    async def start(self) -> str:
        """Open the store and bind; returns the bound address (port 0 resolved)."""
        if self.bound is not None:
            return self.bound
        if self.store is None:
            self.store = await asyncio.to_thread(
                SqliteStore.from_config, self.config.buffer, self.run_dir)
        self.bound = await self.server.start()
        stats = await self.store.stats()
        log.info("buffer.listening", address=self.bound,
                 db=str(self.run_dir / self.config.buffer.db), ready_groups=stats.groups_ready,
                 unconsumed=stats.by_state["waiting"] + stats.by_state["ready"]
                 + stats.by_state["leased"])
        return self.bound

    async def serve(self) -> None:
        """Serve until `stop()` (or `close()`)."""
        await self.start()
        await self._stop.wait()

    def stop(self) -> None:
        """Ask `serve()` to return; safe from a signal handler."""
        self._stop.set()

    async def close(self) -> None:
        """Stop answering, let the store commit what it has queued, close everything."""
        self.stop()
        await self.server.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.store is not None:
            await self.store.close()
        self.tracer.close()
        log.info("buffer.stopped", address=self.bound)

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
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def on_put(self, msg: PutExperiences, ctx: CallContext) -> PutResult:
        outcome = await self.store.put(msg.experiences, self._group_sizes(msg))
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
        deadline = loop.time() + min(msg.wait, max(0.0, ctx.remaining() - REPLY_MARGIN))
        started = time.time()
        dropped = waited = 0
        while True:
            changed = self._changed
            try:
                lease = await self.store.sample(
                    msg.num_groups, policy=msg.policy, min_version=msg.min_version,
                    max_version=msg.max_version, lease_seconds=msg.lease_seconds)
                break
            except NotEnoughExperiences as exc:
                dropped += exc.dropped
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise NotEnoughExperiences(exc.have, exc.need, dropped,
                                               time.time() - started if waited else 0.0) from None
                waited += 1
                try:
                    await asyncio.wait_for(changed.wait(), min(remaining, RECHECK))
                except asyncio.TimeoutError:
                    pass
        if waited:
            self.tracer.record("wait", started, time.time(), what="sample", groups=msg.num_groups)
        self._trace_fill()
        log.debug("buffer.sample", peer=ctx.peer, lease=lease.lease_id, groups=len(lease.group_ids),
                  experiences=len(lease.experiences), dropped_stale=lease.dropped_stale + dropped)
        return SampleResult(lease_id=lease.lease_id, expires_at=lease.expires_at,
                            experiences=lease.experiences, group_ids=lease.group_ids,
                            dropped_stale=lease.dropped_stale + dropped)

    async def on_ack(self, msg: AckLease, ctx: CallContext) -> Ok:
        await self.store.ack(msg.lease_id)
        log.debug("buffer.ack", peer=ctx.peer, lease=msg.lease_id)
        return Ok()

    async def on_release(self, msg: ReleaseLease, ctx: CallContext) -> Ok:
        await self.store.release(msg.lease_id)
        self._notify()
        self._trace_fill()
        log.debug("buffer.release", peer=ctx.peer, lease=msg.lease_id)
        return Ok()

    async def on_stats(self, msg: GetBufferStats, ctx: CallContext) -> BufferStats:
        return await self.store.stats()
