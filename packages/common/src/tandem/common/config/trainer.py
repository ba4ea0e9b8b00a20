"""The `trainer` section: algorithm, optimiser, batches, checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class TrainerConfig(Section):
    """The optimisation loop."""

    device: str = Field(default="cpu", description="cpu, cuda ...")
    advantage: str = Field(default="grpo", description="advantage estimator registry name")
    loss: str = Field(default="ppo_clip", description="policy loss registry name")
    groups_per_step: int = Field(default=8, ge=1, description="groups sampled per trainer step")
    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    micro_batch_tokens: int = Field(default=8192, ge=1, description="token budget per micro-batch")
    checkpoint_every: int = Field(default=0, ge=0, description="steps between checkpoints; 0 = end")
    keep_weight_versions: int = Field(default=3, ge=1, description="weights/v{N} folders kept")
    precision: Literal["auto", "fp32", "bf16"] = "auto"
