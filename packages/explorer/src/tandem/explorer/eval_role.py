"""The eval role (`explorers[].role: eval`): an explorer that only evaluates.

It registers with the master as an `evaluator`, so the sync plan never counts it nor waits for
it: it leases no task, takes no barrier, puts nothing in the buffer. It follows the weights
the trainer publishes (`WeightsPublished` on the master's `weights` topic, as checkpoint
files) and evaluates the `eval` tasksets:

- the weights it starts with, when `eval.at_start`;
- the newest published version whenever that is at least `eval.every` versions past the last
  one it evaluated; versions published while it evaluates are not queued, the next
  evaluation takes the newest (a slow evaluator skips versions, it never falls behind);
- after the run's `Stop` (`eval.at_end`), the newest version published, as the `final` rows
  the trainer waits `eval.final_wait` for.

A version the trainer deleted before it could be loaded (`weights.keep_versions`: the master
keeps only versions rollout explorers hold) is skipped with a warning. Rows go to
run_dir/eval.jsonl with the version they measured, as for an evaluating rollout explorer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from collections.abc import Awaitable, Callable

import structlog

from tandem.common.errors import WaitTimeout
from tandem.common.messages.master import Stop, TrainerGo, WeightsPublished
from tandem.weights import WeightsError

if TYPE_CHECKING:
    from tandem.common.pubsub import Subscriber
    from tandem.common.trace import Tracer

    from .engine import Engine
    from .evaluation import Evaluator
    from .weights import WeightLoader

log = structlog.get_logger(__name__)


class WeightFollower:
    """The eval role's loop, over the parts of one started explorer it drives: the engine
    (only its version is read), the evaluator, the master's subscription, the weight loader.

    `evaluate(step=None, final=...)` evaluates what the engine holds; `stopping()` is true once
    the explorer was asked to stop. The `Stop`'s reason is kept in `stop_reason`.
    """

    def __init__(self, name: str, *, engine: Engine, evaluator: Evaluator,
                 subscriber: Subscriber, loader: WeightLoader, tracer: Tracer, timeout: float,
                 evaluate: Callable[..., Awaitable[None]], stopping: Callable[[], bool]):
        self.name = name
        self.engine = engine
        self.evaluator = evaluator
        self.subscriber = subscriber
        self.loader = loader
        self.tracer = tracer
        self.timeout = timeout  # sync.timeout
        self.evaluate = evaluate
        self.stopping = stopping
        self.stop_reason: str | None = None
        self.newest = engine.version  # the newest version published as files
        self.unloadable: int | None = None  # a version whose load failed: not tried again
        self.evaluations = 0

    async def run(self) -> None:
        """Evaluate as published versions come in, until `Stop` (then the final evaluation)
        or `request_stop()`; fails after `sync.timeout` without any sign of the run."""
        engine = self.engine
        if self.evaluator.due(engine.version):
            await self._evaluate(engine.version)
        timeout = self.timeout
        deadline = time.monotonic() + timeout
        while not self.stopping():
            try:
                stop = await self._drain(wait=min(1.0, max(deadline - time.monotonic(), 0.0)))
            except WaitTimeout:
                if time.monotonic() < deadline:
                    continue
                raise WaitTimeout(
                    f"{self.name} (role eval): no weights, trainer step or stop from the master "
                    f"at {self.subscriber.address} for {timeout:g}s; are the master and the "
                    "trainer running? raise sync.timeout if they are only slow") from None
            deadline = time.monotonic() + timeout
            if stop is not None:
                self.stop_reason = stop.reason
                log.info("explorer.stop_received", explorer=self.name, reason=stop.reason)
                if self.evaluator.cfg.at_end:
                    await self._evaluate(self.newest, final=True)
                return
            if (self.newest > engine.version and self.newest != self.unloadable
                    and self.evaluator.due(self.newest)):
                await self._evaluate(self.newest)

    async def _drain(self, wait: float) -> Stop | None:
        """Read every event already queued (waiting up to `wait` for the first), noting the
        newest version published; the `Stop` if one came. `WaitTimeout` if nothing came."""
        sub = self.subscriber
        event = await sub.recv(wait, what="published weights (master)",
                               timeout_key="sync.timeout")
        while True:
            msg = event.body
            if isinstance(msg, Stop):
                return msg
            if isinstance(msg, WeightsPublished) and msg.method == "checkpoint":
                self.newest = max(self.newest, msg.version)
            elif not isinstance(msg, (WeightsPublished, TrainerGo)):
                log.debug("explorer.eval_ignored", explorer=self.name,
                          message=type(msg).__name__)
            try:
                event = await sub.recv(0.01, what="published weights (master)")
            except WaitTimeout:
                return None

    async def _evaluate(self, version: int, final: bool = False) -> None:
        """Load `version` when the engine holds another, then evaluate what the engine holds."""
        if version > self.engine.version:
            try:
                with self.tracer.span("sync", step=None, version=version,
                                      method="checkpoint") as attrs:
                    attrs.update(await self.loader.load(version, "checkpoint"))
            except (WeightsError, OSError) as exc:
                self.unloadable = version
                log.warning("explorer.eval_load_failed", explorer=self.name, version=version,
                            error=str(exc), hint="deleted already? raise weights.keep_versions")
                if not final:
                    return
        await self.evaluate(step=None, final=final)
        self.evaluations += 1
