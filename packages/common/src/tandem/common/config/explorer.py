"""The `explorers` section: one entry per explorer, each with its engine and workflow."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import Section


class SamplingConfig(Section):
    """How responses are sampled."""

    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    max_tokens: int = Field(default=64, ge=1)
    stop: list[str] = Field(default_factory=list)


class EngineConfig(Section):
    """The inference engine."""

    kind: Literal["transformers", "vllm"] = "transformers"
    device: str = Field(default="cpu", description="cpu, cuda, cuda:1 ...")
    max_batch: int = Field(default=64, ge=1, description="sequences generated at once")
    options: dict[str, Any] = Field(default_factory=dict, description="engine-specific arguments")


class ExplorerConfig(Section):
    """One explorer process."""

    name: str = "explorer-0"
    batch_size: int = Field(default=8, ge=1, description="tasks per explorer step")
    repeat_times: int = Field(default=4, ge=1, description="responses per task (the group size)")
    workflow: str = Field(default="single_turn", description="workflow registry name")
    workflow_args: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
