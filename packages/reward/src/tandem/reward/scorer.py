"""One interface for scoring, in-process or through the service.

    scorer = build_scorer(config.reward, config.transport)   # LocalScorer or RemoteScorer
    scores = await scorer.score([ScoreItem(fn="math", response=text, truth="1/2")])
    await scorer.close()

Each item is scored by `item.fn`, by the weighted `item.functions`, or by the configured
`reward.functions`. The score is the weighted sum of the functions' scores; each function's
score is a component under its name, its parts under `name.part`. An evaluation that overruns
`reward.timeout` (or the caller's deadline) scores 0 with reason `timeout`; one that fails
scores 0 with reason `error: ...`. Neither fails the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import Protocol, Self, runtime_checkable
from collections.abc import Iterable

import structlog

from tandem.common.config.reward import RewardConfig
from tandem.common.config.transport import TransportConfig
from tandem.common.messages.reward import Score, ScoreItem
from tandem.common.reward_client import RemoteScorer

from .base import AsyncReward, PureReward, RewardFunction
from .functions import lookup
from .pool import EvaluationTimeout, WorkerPool

log = structlog.get_logger(__name__)


@runtime_checkable
class Scorer(Protocol):
    """What an explorer calls: `await score(items)` -> one Score per item, in order."""

    async def score(self, items: list[ScoreItem], *, deadline: float | None = None) -> list[Score]:
        ...

    async def close(self) -> None:
        ...


def _compose(parts: list[tuple[str, float, Score]]) -> Score:
    if len(parts) == 1 and parts[0][1] == 1.0:
        name, _, s = parts[0]
        parts = {f"{name}.{k}": v for k, v in s.components.items()}
        return Score(score=s.score, reason=s.reason, components={name: s.score, **parts})
    components: dict[str, float] = {}
    for name, _, s in parts:
        components[name] = s.score
        components.update({f"{name}.{k}": v for k, v in s.components.items()})
    return Score(score=sum(w * s.score for _, w, s in parts), components=components,
                 reason="; ".join(f"{name}: {s.reason}" for name, _, s in parts))


class LocalScorer:
    """Scores in this process: pure functions inline (or, if `isolated`, in killable worker
    processes), the code sandbox and the reward model as asyncio tasks.

    `LocalScorer(functions={"math": 1.0, "format": 0.1})` is enough for in-process use;
    pass `config=` (the `reward` section) for limits, workers and per-function args.
    """

    def __init__(self, functions: dict[str, float] | Iterable[str] | None = None, *,
                 config: RewardConfig | None = None):
        config = config or RewardConfig()
        if functions is not None:
            weights = (dict(functions) if isinstance(functions, dict)
                       else {n: 1.0 for n in functions})
            config = config.model_copy(update={"functions": weights})
            config = RewardConfig.model_validate(config.model_dump())
        self.config = config
        self._functions: dict[str, RewardFunction] = {}
        self._started: dict[str, asyncio.Future] = {}
        self._pool: WorkerPool | None = None
        self._turns: dict[str, asyncio.Semaphore] = {}
        self.stats: dict[str, dict[str, float]] = defaultdict(
            lambda: {"evaluated": 0, "timeouts": 0, "errors": 0, "seconds": 0.0})
        for name in config.functions:
            self._function(name)  # unknown names fail here, not at the first item

    def _function(self, name: str) -> RewardFunction:
        if name not in self._functions:
            self._functions[name] = lookup(name)(self.config)
        return self._functions[name]

    async def start(self) -> None:
        """Optional warm-up: start worker processes, the sandbox and models now."""
        for name in self.config.functions:
            await self._ready(name)

    async def _ready(self, name: str) -> RewardFunction:
        fn = self._function(name)
        if isinstance(fn, PureReward) and fn.isolated:
            if self._pool is None:
                self._pool = WorkerPool(self.config)
            await self._pool.start()
        elif isinstance(fn, AsyncReward):
            if name not in self._started:
                self._started[name] = asyncio.ensure_future(fn.start())
            await asyncio.shield(self._started[name])
        return fn

    async def score(self, items: list[ScoreItem], *, deadline: float | None = None) -> list[Score]:
        """Score every item; `deadline` (time.monotonic()) bounds each evaluation further."""
        return list(await asyncio.gather(*(self._score_item(i, deadline) for i in items)))

    async def _score_item(self, item: ScoreItem, deadline: float | None) -> Score:
        if item.fn is not None:
            weights = {item.fn: 1.0}
        else:
            weights = item.functions or self.config.functions
        names = list(weights)
        scores = await asyncio.gather(*(self._evaluate(n, item, deadline) for n in names))
        return _compose([(n, weights[n], s) for n, s in zip(names, scores)])

    async def _evaluate(self, name: str, item: ScoreItem, deadline: float | None) -> Score:
        stats = self.stats[name]
        try:
            fn = await self._ready(name)
        except Exception as exc:
            stats["errors"] += 1
            detail = exc.args[0] if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            log.warning("reward.function_unavailable", fn=name, error=str(detail))
            return Score(score=0.0, reason=f"error: {detail}"[:300])
        defaults = self.config.args.get(name)
        if defaults:
            item = item.model_copy(update={"args": {**defaults, **item.args}})
        start = time.monotonic()
        try:
            async with self._turn(fn, deadline):
                limit = self.config.timeout
                # A budgeted function (code) stops itself at the deadline it is given, with
                # partial credit; its limit is `budget(item)` instead of reward.timeout.
                budgeted = isinstance(fn, AsyncReward) and getattr(fn, "budgeted", False)
                if budgeted:
                    limit = fn.budget(item)
                if deadline is not None:
                    limit = min(limit, deadline - time.monotonic())
                if limit <= 0:
                    raise EvaluationTimeout()
                if budgeted:
                    # it stops itself with partial credit a little before the limit, which
                    # leaves time to kill and reap its last run (a quarter of a short limit:
                    # on a busy machine the reap alone takes a tenth of a second)
                    stop = time.monotonic() + limit - min(0.5, 0.25 * limit)
                    score = await asyncio.wait_for(fn.score(item, deadline=stop), limit)
                elif isinstance(fn, AsyncReward):
                    score = await asyncio.wait_for(fn.score(item), limit)
                elif fn.isolated:
                    # the limit runs from when a worker takes the item
                    score = await self._pool.evaluate(name, item, self.config.timeout,
                                                      deadline=deadline)
                else:
                    score = fn.score(item)
        except (TimeoutError, EvaluationTimeout):
            stats["timeouts"] += 1
            score = Score(score=0.0, reason="timeout")
        except Exception as exc:
            stats["errors"] += 1
            log.debug("reward.evaluation_failed", fn=name, error=str(exc))
            score = Score(score=0.0, reason=f"error: {exc}"[:300])
        stats["evaluated"] += 1
        stats["seconds"] += time.monotonic() - start
        return score

    @contextlib.asynccontextmanager
    async def _turn(self, fn: RewardFunction, deadline: float | None):
        """Wait for a free worker for `one_per_worker` functions (until the deadline at most),
        so that the evaluation's own time limit counts only its running time."""
        if not (isinstance(fn, AsyncReward) and fn.one_per_worker):
            yield
            return
        turns = self._turns.setdefault(fn.name, asyncio.Semaphore(self.config.workers))
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        await asyncio.wait_for(turns.acquire(), wait)
        try:
            yield
        finally:
            turns.release()

    async def close(self) -> None:
        for name, fn in self._functions.items():
            if isinstance(fn, AsyncReward) and name in self._started:
                started = self._started.pop(name)
                if not started.done():
                    started.cancel()
                await asyncio.gather(started, return_exceptions=True)
                await fn.close()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def build_scorer(reward: RewardConfig, transport: TransportConfig | None = None) -> Scorer:
    """The scorer the config asks for: RemoteScorer when `reward.service`, else LocalScorer."""
    if reward.service:
        return RemoteScorer.from_config(reward, transport)
    return LocalScorer(config=reward)
