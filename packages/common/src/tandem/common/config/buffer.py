"""The `buffer` section: store location, capacity, sampling policy, leases, retention."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class BufferConfig(Section):
    """The durable experience store and how the trainer samples from it."""

    address: str = Field(default="tcp://127.0.0.1:5560", description="RPC (ROUTER) address")
    db: str = Field(default="buffer.sqlite", description="SQLite file, relative to the run dir")
    capacity: int = Field(default=1_000_000, ge=1, description="unconsumed experiences held at most")
    policy: Literal["fifo", "newest", "priority"] = "fifo"
    lease_seconds: float = Field(default=120.0, gt=0, description="before a lease returns its groups")
    reuse: int = Field(default=1, ge=1, description="times an experience may be trained on (replay)")
    keep_consumed: bool = Field(default=False, description="keep consumed rows instead of deleting")
