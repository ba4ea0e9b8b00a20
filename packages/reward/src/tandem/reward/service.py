"""The reward service: score requests over tandem RPC, evaluated by a LocalScorer.

Each `reward.score` request is one batch, scored concurrently by the scorer's worker pool
(`reward.workers` processes for isolated pure functions, as many concurrent code sandboxes).
Every evaluation is bounded by `reward.timeout` and by the request's own deadline (the
caller's time-to-live, less a margin to stop the evaluations and send the reply), so an
explorer always gets an answer in time: overrun evaluations score 0 with reason `timeout` and
are counted.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from tandem.common.config import RunConfig
from tandem.common.errors import RequestFailed
from tandem.common.messages.reward import GetRewardStats, RewardStats, ScoreBatch, Scores
from tandem.common.metrics import MetricsEndpoint
from tandem.common.rpc import CallContext, RpcServer

from .scorer import LocalScorer

log = structlog.get_logger(__name__)

REPLY_MARGIN = 0.1  # of the caller's time-to-live (0.05 to 1 s) kept for stopping and replying


class RewardService:
    """`RewardService(config)`; `await start()` (the bound address), `serve()`, `close()`.

    `serve()` returns on `request_stop()`; the caller closes."""

    def __init__(self, config: RunConfig, *, address: str | None = None):
        self.config = config
        self.reward = config.reward
        self.scorer = LocalScorer(config=self.reward)
        self.server = RpcServer(address or self.reward.address, name="reward",
                                transport=config.transport)
        self.server.register(ScoreBatch, self._on_score, limits={"items": self.reward.max_batch})
        self.server.register(GetRewardStats, self._on_stats)
        self.requests = 0
        self.items = 0
        self._stop = asyncio.Event()
        self.metrics = MetricsEndpoint(config.logging.metrics, "reward", run_dir=config.run_dir)
        self.metrics.gauge_fn("requests", "score requests served", lambda: self.requests)
        self.metrics.gauge_fn("items", "items scored", lambda: self.items)
        self.metrics.gauge_fn(
            "scoring", "scoring by function: evaluated, timeouts, errors, seconds (running totals)",
            lambda: {(fn, stat): v for fn, stats in self.scorer.stats.items()
                     for stat, v in stats.items()}, labels=("function", "stat"))
        self.metrics.rpc_errors(self.server)

    async def start(self) -> str:
        await self.scorer.start()
        bound = await self.server.start()
        self.metrics.start()
        log.info("reward.serving", address=bound, functions=self.reward.functions,
                 workers=self.reward.workers, timeout=self.reward.timeout)
        return bound

    async def serve(self) -> None:
        """Serve until `request_stop()` or `close()`; the caller then calls `close()`. A stop
        requested before serve() starts nothing; one that comes while the worker processes
        start (seconds on a loaded machine) ends the start at once."""
        if self._stop.is_set():
            return
        starting = asyncio.ensure_future(self.start())
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # a start that failed raises here
                await stopped
        finally:
            for task in (starting, stopped):
                task.cancel()
            await asyncio.gather(starting, stopped, return_exceptions=True)

    def request_stop(self) -> None:
        """Ask `serve()` to return; safe from a signal handler."""
        self._stop.set()

    async def _on_score(self, msg: ScoreBatch, ctx: CallContext) -> Scores:
        if len(msg.items) > self.reward.max_batch:
            raise RequestFailed("too_large", f"{len(msg.items)} items in one request; the service "
                                             f"takes reward.max_batch={self.reward.max_batch}")
        self.requests += 1
        self.items += len(msg.items)
        deadline = ctx.deadline - min(max(REPLY_MARGIN * ctx.remaining(), 0.05), 1.0)
        start = time.monotonic()
        scores = await self.scorer.score(msg.items, deadline=deadline)
        log.debug("reward.scored", peer=ctx.peer, items=len(msg.items),
                  seconds=round(time.monotonic() - start, 4))
        return Scores(scores=scores)

    async def _on_stats(self, msg: GetRewardStats, ctx: CallContext) -> RewardStats:
        return RewardStats(requests=self.requests, items=self.items,
                           by_function={k: dict(v) for k, v in self.scorer.stats.items()},
                           workers=self.reward.workers)

    async def close(self) -> None:
        self._stop.set()
        await self.server.close()
        await self.scorer.close()
        self.metrics.close()
        log.info("reward.stopped", requests=self.requests, items=self.items,
                 by_function={k: dict(v) for k, v in self.scorer.stats.items()})
