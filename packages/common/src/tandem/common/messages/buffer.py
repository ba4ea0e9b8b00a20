"""Buffer protocol: explorers put experiences, the trainer samples whole groups under a lease."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Message, Ok, Request, wire
from .experience import Experience


@wire("buffer.put.reply")
class PutResult(Message):
    """Buffer to explorer: the batch is durable (committed) in the store."""

    stored: int = Field(description="experiences newly stored")
    duplicates: int = Field(description="experiences whose id was already stored (idempotent put)")


@wire("buffer.put", reply=PutResult)
class PutExperiences(Request):
    """Explorer to buffer: store these experiences; a `full` error carries retry_after."""

    experiences: list[Experience]


@wire("buffer.sample.reply")
class SampleResult(Message):
    """Buffer to trainer: whole groups, leased until `expires_at` (unix seconds)."""

    lease_id: str
    expires_at: float
    experiences: list[Experience]
    group_ids: list[str]
    dropped_stale: int = Field(default=0, description="experiences dropped by min_version")


@wire("buffer.sample", reply=SampleResult)
class SampleGroups(Request):
    """Trainer to buffer: lease `num_groups` complete groups; waits up to `wait` seconds."""

    num_groups: int = Field(ge=1)
    policy: Literal["fifo", "newest", "priority"] | None = None
    min_version: int | None = Field(default=None, description="staleness filter")
    max_version: int | None = Field(default=None, description="only groups at or below it")
    lease_seconds: float | None = Field(default=None, gt=0)
    wait: float = Field(default=0.0, ge=0, description="seconds to wait for enough groups")


@wire("buffer.ack", reply=Ok)
class AckLease(Request):
    """Trainer to buffer: the step using this lease is done; its experiences are consumed."""

    lease_id: str


@wire("buffer.release", reply=Ok)
class ReleaseLease(Request):
    """Trainer to buffer: give this lease's groups back unconsumed."""

    lease_id: str


@wire("buffer.stats.reply")
class BufferStats(Message):
    """Buffer to anyone: what the store holds."""

    by_state: dict[str, int]
    by_version: dict[int, int]
    oldest_version: int | None
    newest_version: int | None
    bytes: int
    groups_waiting: int = Field(description="groups not yet complete")
    groups_ready: int
    dropped_stale: int
    capacity: int


@wire("buffer.stats", reply=BufferStats)
class GetBufferStats(Request):
    """Anyone to buffer: report counts."""
