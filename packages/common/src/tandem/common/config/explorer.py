"""The `explorers` section: one entry per explorer, each with its engine, sampling and workflow."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Section


class SamplingConfig(Section):
    """How responses are sampled. Behaviour logprobs are taken under exactly this policy:
    `log_softmax` of logits / temperature after top-k then top-p truncation (docs/explorer.md)."""

    temperature: float = Field(
        default=1.0, ge=0, description="0 is greedy (logprobs then under the unscaled logits)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus mass kept; 1 disables")
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    max_tokens: int = Field(default=64, ge=1, description="tokens per response (per model turn)")
    stop: list[str] = Field(default_factory=list, description="strings that end a response")
    seed: int | None = Field(
        default=None, description="fixes the sampling stream of every call; null: seeded per call")

    @model_validator(mode="after")
    def _stops_not_empty(self) -> "SamplingConfig":
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop: an empty string would end every response at once; "
                             "remove it")
        return self


class EngineConfig(Section):
    """The inference engine."""

    kind: Literal["transformers", "vllm"] = Field(
        default="transformers", description="transformers: the embedded engine (CPU or CUDA)")
    device: str = Field(default="cpu", description="cpu, cuda, cuda:1 ...")
    max_batch: int = Field(default=64, ge=1, description="sequences generated at once")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="engine-specific arguments (transformers: seed, attn_implementation, "
                    "threads: torch intra-op threads of the process)")


class ExplorerConfig(Section):
    """One explorer process."""

    name: str = Field(default="explorer-0", min_length=1, description="unique among explorers")
    batch_size: int = Field(default=8, ge=1, description="tasks per explorer step")
    repeat_times: int = Field(default=4, ge=1, description="responses per task (the group size)")
    workflow: str = Field(default="single_turn", description="single_turn or multi_turn")
    workflow_args: dict[str, Any] = Field(
        default_factory=dict, description="the workflow's arguments (docs/explorer.md)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    put_timeout: float = Field(
        default=300.0, gt=0,
        description="seconds to keep retrying a put the buffer refuses as full before failing")
    drain_seconds: float = Field(
        default=30.0, ge=0,
        description="on SIGTERM, seconds the running step may take to finish before its lease "
                    "is abandoned to the master")

    @model_validator(mode="after")
    def _name_is_a_topic(self) -> "ExplorerConfig":
        if any(ch.isspace() for ch in self.name) or "/" in self.name or "." in self.name:
            raise ValueError(f"name {self.name!r}: no spaces, '/' or '.' (it names a PUB topic, "
                             "which ZeroMQ matches by prefix, and a weight-group member)")
        return self
