"""The `sync` section (DESIGN §4): method, interval, offset, staleness bound, timeout, presets."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Section

from ..sync import PRESETS

Preset = Literal["synchronous", "one_step_off_policy", "fully_async", "multi_explorer_async"]


class SyncConfig(Section):
    """When explorers pick up new weights and how the weights travel."""

    preset: Preset | None = Field(
        default=None, description="fills the knobs below; keys given explicitly win")
    method: Literal["nccl", "checkpoint"] = Field(
        default="checkpoint",
        description="nccl: a process group broadcast (gloo without a GPU); checkpoint: files + notice")
    interval: int = Field(default=1, ge=1, description="explorers sync every `interval` steps")
    offset: int | None = Field(
        default=0, ge=0,
        description="explorer steps the explorer may run ahead at a sync point; null = asynchronous")
    max_staleness: int = Field(
        default=4, ge=0,
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
    def _consistent(self) -> "SyncConfig":
        if self.offset is None and self.method == "nccl":
            raise ValueError(
                "sync.offset: null (asynchronous) cannot use sync.method: nccl, because a broadcast "
                "needs both sides at a sync point; set sync.method: checkpoint or give sync.offset")
        return self

    @property
    def asynchronous(self) -> bool:
        return self.offset is None
