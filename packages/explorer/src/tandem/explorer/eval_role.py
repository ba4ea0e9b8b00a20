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

import structlog

from tandem.common.errors import WaitTimeout
from tandem.common.messages.master import Stop, TrainerGo, WeightsPublished
from tandem.weights import WeightsError

if TYPE_CHECKING:
    from .service import Explorer

log = structlog.get_logger(__name__)


class WeightFollower:
    """The eval role's loop over one started `Explorer` (engine, evaluator, subscription)."""

    def __init__(self, explorer: "Explorer"):
        self.explorer = explorer
        self.evaluator = explorer.evaluator
        self.newest = explorer.engine.version  # the newest version published as files
        self.unloadable: int | None = None  # a version whose load failed: not tried again
        self.evaluations = 0

    async def run(self) -> None:
        """Evaluate as published versions come in, until `Stop` (then the final evaluation)
        or `request_stop()`; fails after `sync.timeout` without any sign of the run."""
        ex = self.explorer
        if self.evaluator.due(ex.engine.version):
            await self._evaluate(ex.engine.version)
        timeout = ex.config.sync.timeout
        deadline = time.monotonic() + timeout
        while not ex._stopping:
            try:
                stop = await self._drain(wait=min(1.0, max(deadline - time.monotonic(), 0.0)))
            except WaitTimeout:
                if time.monotonic() < deadline:
                    continue
                raise WaitTimeout(
                    f"{ex.name} (role eval): no weights, trainer step or stop from the master "
                    f"at {ex.subscriber.address} for {timeout:g}s; are the master and the "
                    "trainer running? raise sync.timeout if they are only slow") from None
            deadline = time.monotonic() + timeout
            if stop is not None:
                ex.stop_reason = stop.reason
                log.info("explorer.stop_received", explorer=ex.name, reason=stop.reason)
                if self.evaluator.cfg.at_end:
                    await self._evaluate(self.newest, final=True)
                return
            if (self.newest > ex.engine.version and self.newest != self.unloadable
                    and self.evaluator.due(self.newest)):
                await self._evaluate(self.newest)

    async def _drain(self, wait: float) -> Stop | None:
        """Read every event already queued (waiting up to `wait` for the first), noting the
        newest version published; the `Stop` if one came. `WaitTimeout` if nothing came."""
        sub = self.explorer.subscriber
        event = await sub.recv(wait, what="published weights (master)",
                               timeout_key="sync.timeout")
        while True:
            msg = event.body
            if isinstance(msg, Stop):
                return msg
            if isinstance(msg, WeightsPublished) and msg.method == "checkpoint":
                self.newest = max(self.newest, msg.version)
            elif not isinstance(msg, (WeightsPublished, TrainerGo)):
                log.debug("explorer.eval_ignored", explorer=self.explorer.name,
                          message=type(msg).__name__)
            try:
                event = await sub.recv(0.01, what="published weights (master)")
            except WaitTimeout:
                return None

    async def _evaluate(self, version: int, final: bool = False) -> None:
        """Load `version` when the engine holds another, then evaluate what the engine holds."""
        ex = self.explorer
        if version > ex.engine.version:
            try:
                with ex.tracer.span("sync", step=None, version=version,
                                    method="checkpoint") as attrs:
                    attrs.update(await ex.loader.load(version, "checkpoint"))
            except (WeightsError, OSError) as exc:
                self.unloadable = version
                log.warning("explorer.eval_load_failed", explorer=ex.name, version=version,
                            error=str(exc), hint="deleted already? raise weights.keep_versions")
                if not final:
                    return
        await ex._evaluate(step=None, final=final)
        self.evaluations += 1
