"""The `sync` section (docs/design.md §4): method, interval, offset, staleness bound (fixed, or
`auto`: set by the master from the trainer's metrics), timeout, presets."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ..staleness import StalenessRule
from ..sync import PRESETS, Method, check_knobs
from .base import Section

Preset = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the names live in PRESETS alone


class StalenessTarget(Section):
    """The off-policy cost `sync.max_staleness: auto` keeps under a bound."""

    metric: str = Field(
        default="mismatch/kl",
        description="a trainer step metric (its TrainerStepDone report): mismatch/kl, "
                    "correction/<name>/masked_frac, ...")
    below: float = Field(default=0.02, gt=0,
                         description="narrow the bound when the metric's mean rises above this")


class AutoStalenessConfig(Section):
    """How the master moves the staleness bound when `sync.max_staleness: auto` (docs/sync.md)."""

    target: StalenessTarget = Field(default_factory=StalenessTarget)
    min: int = Field(default=1, ge=0, description="the bound never goes below this")
    max: int = Field(default=8, ge=0, description="the bound never goes above this")
    start: int | None = Field(default=None, ge=0,
                              description="the bound the run starts with (null: min)")
    patience: int = Field(
        default=2, ge=1,
        description="trainer steps measured since the bound last changed before it may change "
                    "again; the values judged are their metrics")
    widen_below: float = Field(
        default=0.5, gt=0, le=1,
        description="widen by one while every value judged is <= this share of target.below "
                    "(between it and target.below the bound holds)")

    @model_validator(mode="after")
    def _consistent(self) -> AutoStalenessConfig:
        self.rule()
        return self

    def rule(self) -> StalenessRule:
        return StalenessRule(metric=self.target.metric, below=self.target.below, min=self.min,
                             max=self.max, start=self.start, patience=self.patience,
                             widen_below=self.widen_below)


class SyncConfig(Section):
    """When explorers pick up new weights and how the weights travel."""

    preset: Preset | None = Field(
        default=None, description="fills the knobs below; keys given explicitly win")
    method: Method = Field(
        default="checkpoint",
        description="nccl: a process group broadcast (gloo without a GPU); checkpoint: files + notice")
    # the knobs' rules (ranges, and which combine) live in `tandem.common.sync.check_knobs`
    interval: int = Field(default=1, description="explorers sync every `interval` steps (>= 1)")
    offset: int | None = Field(
        default=0,
        description="explorer steps the explorer may run ahead at a sync point (>= 0); "
                    "null = asynchronous")
    max_staleness: int | Literal["auto"] = Field(
        default=4,
        description="asynchronous runs: step e may not start while the newest version < e - "
                    "this; auto: the master sets it within sync.auto")
    auto: AutoStalenessConfig = Field(
        default_factory=AutoStalenessConfig,
        description="max_staleness: auto: the target and limits of the bound")
    timeout: float = Field(default=600.0, gt=0, description="seconds any barrier or transfer may wait")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            preset = PRESETS.get(data["preset"])
            if preset is not None:
                data = {**preset, **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> SyncConfig:
        if self.auto_staleness and self.offset is not None:
            raise ValueError("sync.max_staleness: auto moves the bound of asynchronous plans "
                             "only; set sync.offset: null (sync.preset: fully_async) or give "
                             "sync.max_staleness a number")
        check_knobs(self.method, self.interval, self.offset, self.initial_staleness)
        return self

    @property
    def auto_staleness(self) -> bool:
        return self.max_staleness == "auto"

    @property
    def initial_staleness(self) -> int:
        """The bound the run starts with: the number given, or `auto.start` (else `auto.min`)."""
        if self.auto_staleness:
            return self.auto.rule().first_bound
        return self.max_staleness

    @property
    def asynchronous(self) -> bool:
        return self.offset is None
