"""The `reward` section: which reward functions score a task, and the optional service."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class RewardConfig(Section):
    """Reward functions by registry name with weights; in-process unless `service` is set."""

    functions: dict[str, float] = Field(
        default_factory=lambda: {"math": 1.0}, description="registry name -> weight")
    service: bool = Field(default=False, description="score through the tandem-reward service")
    address: str = Field(default="tcp://127.0.0.1:5570", description="service RPC address")
    workers: int = Field(default=2, ge=1, description="service worker processes")
    timeout: float = Field(default=10.0, gt=0, description="seconds per evaluation before score 0")
