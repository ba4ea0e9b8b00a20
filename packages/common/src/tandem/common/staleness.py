"""The staleness bound that sets itself (`sync.max_staleness: auto`, docs/sync.md): a pure rule.

An asynchronous plan's `max_staleness` trades throughput (explorers wait less for the trainer)
against off-policy cost (rollouts from older weights). With `auto` the master measures that cost
in the trainer's own step metrics (`TrainerStepDone.metrics`, e.g. `mismatch/kl` or a
correction's `correction/<name>/masked_frac`) and moves the bound by this rule:

- **widen** by one while every value measured over the last `patience` trainer steps stays at or
  under `widen_below * below` (additive increase);
- **narrow** to half (rounded down) once their mean rises above `below` (multiplicative decrease,
  as TCP's congestion window: a bound too wide costs learning, one too narrow only speed);
- **hold** in between: the band from `widen_below * below` to `below` is the hysteresis that
  keeps the bound from flapping on a metric that hovers near its target;
- always within `[min, max]`; and only on values measured since the bound last changed, at
  least `patience` of them, since the steps trained right after a change still hold rollouts
  granted under the old bound.

No sockets, no clock: the master folds each step's metrics in with `observe`, asks `decide`, and
journals a change (`StalenessSet`) so a restarted master resumes the bound; `RunClock` grants
with the bound of the newest decision (`tandem.master.clock`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

Action = Literal["widen", "narrow", "hold"]


@dataclass(frozen=True)
class StalenessRule:
    """The knobs of `sync.auto` (docs/sync.md)."""

    metric: str = "mismatch/kl"
    below: float = 0.02
    min: int = 1
    max: int = 8
    start: int | None = None  # None: `min`
    patience: int = 2
    widen_below: float = 0.5

    def __post_init__(self) -> None:
        if not self.metric:
            raise ValueError("sync.auto.target.metric must name a trainer metric, e.g. "
                             "mismatch/kl")
        if not self.below > 0:
            raise ValueError(f"sync.auto.target.below must be > 0, got {self.below}")
        if self.min < 0 or self.max < self.min:
            raise ValueError(f"sync.auto needs 0 <= min <= max, got min {self.min}, max "
                             f"{self.max}")
        if self.start is not None and not self.min <= self.start <= self.max:
            raise ValueError(f"sync.auto.start must lie in [min, max] = [{self.min}, "
                             f"{self.max}], got {self.start}")
        if self.patience < 1:
            raise ValueError(f"sync.auto.patience must be >= 1, got {self.patience}")
        if not 0 < self.widen_below <= 1:
            raise ValueError(f"sync.auto.widen_below must be in (0, 1], got {self.widen_below}")

    @property
    def first_bound(self) -> int:
        return self.min if self.start is None else self.start

    def initial(self) -> StalenessState:
        return StalenessState(bound=self.first_bound)

    def observe(self, state: StalenessState, metrics: dict[str, Any]) -> StalenessState:
        """`state` with one trainer step's metrics folded in; a step without the metric (or
        with a value that is not a finite number) adds nothing."""
        value = metrics.get(self.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return state
        return replace(state, measured=(*state.measured, float(value))[-self.patience:])

    def decide(self, state: StalenessState) -> StalenessDecision:
        """What the bound should be, given the values measured since it last changed."""
        bound, values = state.bound, state.measured
        if len(values) < self.patience:
            return StalenessDecision("hold", bound, bound, None, (
                f"{len(values)} of {self.patience} steps measured since the bound was set"))
        mean = sum(values) / len(values)
        if mean > self.below:
            if bound <= self.min:
                return StalenessDecision("hold", bound, bound, mean, (
                    f"{self.metric} {mean:.4g} > {self.below:g}, but the bound is at min "
                    f"{self.min}"))
            new = max(self.min, bound // 2)
            return StalenessDecision("narrow", new, bound, mean,
                                     f"{self.metric} {mean:.4g} > {self.below:g}")
        widen_at = self.widen_below * self.below
        if max(values) <= widen_at:
            if bound >= self.max:
                return StalenessDecision("hold", bound, bound, mean, (
                    f"{self.metric} <= {widen_at:.4g}, but the bound is at max {self.max}"))
            return StalenessDecision("widen", bound + 1, bound, mean, (
                f"{self.metric} <= {widen_at:.4g} over {len(values)} steps"))
        return StalenessDecision("hold", bound, bound, mean, (
            f"{self.metric} {mean:.4g} between {widen_at:.4g} and {self.below:g}"))


@dataclass(frozen=True)
class StalenessState:
    """The current bound and the metric's newest values measured since it was set (at most
    `patience` of them)."""

    bound: int
    measured: tuple[float, ...] = ()

    def set(self, bound: int) -> StalenessState:
        """The state after a decision moved the bound to `bound`: nothing measured under it."""
        return StalenessState(bound=bound)


@dataclass(frozen=True)
class StalenessDecision:
    """`decide`'s answer: the bound from now on, the one before, the mean it judged, why."""

    action: Action
    bound: int
    previous: int
    value: float | None
    why: str

    @property
    def changed(self) -> bool:
        return self.bound != self.previous


__all__ = ["Action", "StalenessDecision", "StalenessRule", "StalenessState"]
