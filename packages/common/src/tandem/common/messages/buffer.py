"""Buffer protocol: explorers put experiences, the trainer samples whole groups under a lease.

A trainer acks each lease with the step that consumed it, tells the buffer when a checkpoint is
durable, and on a restart from a checkpoint releases its dead incarnation's leases and rewinds
the buffer to that checkpoint's step (docs/buffer.md, "Restarts").
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Array, Message, Ok, Request, wire
from .experience import Experience


@wire("buffer.put.reply")
class PutResult(Message):
    """Buffer to explorer: the batch is durable (committed) in the store."""

    stored: int = Field(description="experiences newly stored")
    duplicates: int = Field(description="experiences whose id was already stored (idempotent put)")
    dropped_stale: int = Field(
        default=0,
        description="experiences for a group already dropped as stale, counted not stored")


@wire("buffer.put", reply=PutResult)
class PutExperiences(Request):
    """Explorer to buffer: store these experiences; a `full` error carries retry_after.

    A group is complete, and sampleable, once it holds `group_size` experiences. `group_size`
    (the explorer's `repeat_times`) applies to every group in the batch; when it is None the
    buffer takes `repeat_times` of the explorer named by each experience's `explorer` field,
    or the single `repeat_times` all configured explorers share.
    """

    experiences: list[Experience]
    group_size: int | None = Field(default=None, ge=1, description="experiences per group")
    images: dict[str, Array("uint8", 1)] = Field(
        default_factory=dict,
        description="normalised PNG bytes by content hash, of the images the experiences "
                    "refer to that the buffer may not hold yet: each once per put (raw frames, "
                    "never lists); the buffer checks each hash against its bytes")


@wire("buffer.sample.reply")
class SampleResult(Message):
    """Buffer to trainer: whole groups, leased until `expires_at` (unix seconds)."""

    lease_id: str
    expires_at: float
    experiences: list[Experience]
    group_ids: list[str]
    dropped_stale: int = Field(default=0, description="experiences dropped by min_version")
    images: dict[str, Array("uint8", 1)] = Field(
        default_factory=dict,
        description="normalised PNG bytes of every image the experiences refer to, by content "
                    "hash, each once however many experiences share it")


@wire("buffer.sample", reply=SampleResult)
class SampleGroups(Request):
    """Trainer to buffer: lease `num_groups` complete groups; waits up to `wait` seconds. With
    `min_groups`, answers as soon as that many are ready, leasing up to `num_groups` of those
    there are: a trainer gathers its step's groups in parts while they are rolled out."""

    num_groups: int = Field(ge=1)
    min_groups: int | None = Field(
        default=None, ge=1, description="answer once this many are ready (at most num_groups); "
        "None: num_groups, all or nothing")
    policy: Literal["fifo", "newest", "priority"] | None = None
    min_version: int | None = Field(default=None, description="staleness filter")
    max_version: int | None = Field(default=None, description="only groups at or below it")
    lease_seconds: float | None = Field(default=None, gt=0)
    wait: float = Field(
        default=0.0, ge=0,
        description="seconds to wait for enough groups (capped by buffer.max_sample_wait)")
    holder: str | None = Field(
        default=None, max_length=256,
        description="who holds the lease, stable across the holder's restarts (the trainer's "
                    "name), so ReleaseLeases can give back what a dead incarnation held")


@wire("buffer.ack", reply=Ok)
class AckLease(Request):
    """Trainer to buffer: the step using this lease is done; its experiences are consumed."""

    lease_id: str
    step: int | None = Field(
        default=None, ge=0,
        description="the trainer step that consumed the groups (TrainerGo.step); RewindTo "
                    "undoes the acks of steps at or after a checkpoint's. None: never rewound")
    more: list[str] = Field(
        default_factory=list, description="further leases the same step consumed (its groups "
        "gathered in parts), acked in the same transaction: all of them or none")


@wire("buffer.release_leases.reply")
class LeasesReleased(Message):
    """Buffer to trainer: how many leases ReleaseLeases gave back."""

    leases: int


@wire("buffer.release_leases", reply=LeasesReleased)
class ReleaseLeases(Request):
    """Trainer to buffer, at start: give back every lease `holder` holds (a dead incarnation's),
    so their groups are sampleable now instead of after buffer.lease_seconds."""

    holder: str = Field(min_length=1, max_length=256)


@wire("buffer.rewind.reply")
class Rewound(Message):
    """Buffer to trainer: what RewindTo made sampleable again."""

    groups: int = Field(description="consumed groups that are ready again")
    uses: int = Field(description="acked uses undone (more than groups with buffer.reuse > 1)")
    leases_released: int = Field(description="outstanding leases given back")


@wire("buffer.rewind", reply=Rewound)
class RewindTo(Request):
    """Trainer to buffer, when resuming from a checkpoint holding steps 0..step-1: undo every
    ack of a step >= `step`, so those groups are trained again, once, into the new lineage;
    releases every lease. Idempotent and durable; fails `rewind_too_far` when it needs rows
    pruned after a later CheckpointSaved."""

    step: int = Field(ge=0, description="the step the trainer resumes at")


@wire("buffer.checkpoint", reply=Ok)
class CheckpointSaved(Request):
    """Trainer to buffer: a checkpoint holding steps 0..step-1 is durable; groups consumed by
    earlier steps will never be rewound, so their rows may be pruned."""

    step: int = Field(ge=0, description="steps the checkpoint holds (the step it resumes at)")


@wire("buffer.release", reply=Ok)
class ReleaseLease(Request):
    """Trainer to buffer: give this lease's groups back unconsumed."""

    lease_id: str


@wire("buffer.stats.reply")
class BufferStats(Message):
    """Buffer to anyone: what the store holds."""

    by_state: dict[str, int] = Field(
        description="experiences per state: waiting, ready, leased, consumed, stale")
    by_version: dict[int, int] = Field(description="unconsumed experiences per policy version")
    oldest_version: int | None
    newest_version: int | None
    bytes: int = Field(description="array bytes of the experiences whose rows are stored")
    groups_waiting: int = Field(description="groups not yet complete")
    groups_ready: int
    dropped_stale: int
    capacity: int
    leases: int = Field(default=0, description="leases outstanding")
    db_bytes: int = Field(default=0, description="size of the database files on disk")


@wire("buffer.stats", reply=BufferStats)
class GetBufferStats(Request):
    """Anyone to buffer: report counts."""
