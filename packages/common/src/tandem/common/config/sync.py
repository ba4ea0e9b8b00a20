"""The `sync` section (docs/design.md §4): method, interval, offset, staleness bound, timeout, presets."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ..sync import PRESETS, Method, check_knobs
from .base import Section

Preset = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the names live in PRESETS alone


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
    max_staleness: int = Field(
        default=4,
        description="asynchronous runs: step e may not start while the newest version < e - this")
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
        check_knobs(self.method, self.interval, self.offset, self.max_staleness)
        return self

    @property
    def asynchronous(self) -> bool:
        return self.offset is None
