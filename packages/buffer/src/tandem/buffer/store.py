"""The `ExperienceStore` interface: what any durable store behind the buffer service promises.

Semantics (docs/design.md §6), the same for every implementation:

- A group is all experiences with one `group_id` (one task under one policy version). It is
  *waiting* until it holds `group_size` experiences, then *ready*. Only ready groups are sampled,
  always whole.
- `put` is idempotent by experience id and returns only after the experiences are durable.
  A put that would push the unconsumed experiences past `capacity` fails with `BufferFull`
  (nothing of that batch is stored). Puts into a group already consumed count as duplicates,
  and so do ids already stored even under another policy version (the same task rolled out
  again after its explorer died: group ids name the task's place in the run);
  puts into a group dropped as stale are counted as stale and not stored.
- `sample` leases `num_groups` ready groups at once or none (`NotEnoughExperiences`). Before it
  chooses, ready and waiting groups below `min_version` are dropped as *stale*, permanently, and
  counted. Order: groups used fewer times first (replay only fills in), then the policy: `fifo`
  oldest version first, `newest` newest version first, `priority` highest priority first; ties
  by arrival. A lease may name its `holder` (the consumer, stable across its restarts).
- `ack(lease, step)` counts one use of each group, recorded with the trainer step that used it;
  a group used `reuse` times is *consumed*, else ready again. `release(lease)` or the lease's
  expiry returns its groups to ready without a use; `release_holder(holder)` does it for every
  lease of one consumer at once. An expired lease is unknown: acking it fails with
  `UnknownLease`.
- `rewind(step)`: every use recorded by an ack with a step >= `step` is undone, so a group a
  trainer consumed after its checkpoint is ready again, and every lease is released. Idempotent
  and durable. `checkpointed(step)` tells the store the trainer's newest checkpoint holds steps
  below `step`: uses before it can never be rewound. A rewind needing rows already deleted fails
  with `RewindTooFar` and changes nothing.
- Consumed and stale groups keep a small tombstone row forever (so late duplicates are still
  recognised); their experience rows are deleted beyond the newest `keep_consumed`, except rows
  of groups consumed at or after the newest checkpoint's step, which a rewind may still need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.common.errors import TandemError
from tandem.common.messages import BufferStats, Experience

STATES = ("waiting", "ready", "leased", "consumed", "stale")
POLICIES = ("fifo", "newest", "priority")


class StoreError(TandemError):
    """A store operation refused; the service turns each subclass into a reply code."""

    @property
    def message(self) -> str:
        """The one-line message the reply carries."""
        return str(self)


class BufferFull(StoreError):
    """The store holds `capacity` unconsumed experiences; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        self.retry_after = retry_after
        super().__init__(message)


class NotEnoughExperiences(StoreError):
    """Fewer ready groups than asked for (after the staleness filter).

    The stale groups dropped while looking stay dropped: the store commits that part of the
    sample even though it raises (`keeps_changes`)."""

    keeps_changes = True

    def __init__(self, have: int, need: int, dropped: int = 0, waited: float = 0.0,
                 reason: str = ""):
        self.have = have
        self.need = need
        self.dropped = dropped  # experiences dropped as stale while trying
        detail = f", dropped {dropped} stale experiences" if dropped else ""
        if waited:
            detail += f", after waiting {waited:.1f} s"
        super().__init__(f"not enough experiences (have {have} ready groups, need {need})"
                         f"{detail}{reason}")


class UnknownLease(StoreError):
    """The lease was acked or released already, expired, or never existed."""

    def __init__(self, lease_id: str):
        self.lease_id = lease_id
        super().__init__(f"lease {lease_id!r} is unknown: already acked or released, or it "
                         "expired (buffer.lease_seconds) and its groups went back")


class BadPut(StoreError):
    """A request that contradicts what the store holds (group size, version, overflow)."""


class RewindTooFar(StoreError):
    """A rewind needs the rows of groups already deleted (consumed before a checkpoint the
    trainer reported)."""

    def __init__(self, step: int, groups: int, checkpoint_step: int):
        self.step = step
        self.groups = groups
        self.checkpoint_step = checkpoint_step
        super().__init__(
            f"cannot rewind to step {step}: {groups} groups consumed at or after it have had "
            f"their rows deleted, because the trainer reported a checkpoint at step "
            f"{checkpoint_step}; resume from that checkpoint or a newer one")


@dataclass(slots=True)
class PutOutcome:
    """What a put did: newly stored, already there, and counted-not-stored as stale."""

    stored: int = 0
    duplicates: int = 0
    dropped_stale: int = 0


@dataclass(slots=True)
class Lease:
    """Whole groups handed out to `holder` until `expires_at` (unix seconds)."""

    lease_id: str
    expires_at: float
    group_ids: list[str]
    experiences: list[Experience]
    dropped_stale: int = 0
    holder: str | None = None
    images: dict[str, bytes] = field(default_factory=dict)  # every image they refer to, once


@dataclass(slots=True)
class RewindOutcome:
    """What a rewind did: groups sampleable again, uses undone, leases released."""

    groups: int = 0
    uses: int = 0
    leases_released: int = 0


class ExperienceStore(ABC):
    """A durable store of experiences with group sampling under leases (module docstring)."""

    @abstractmethod
    async def put(self, experiences: list[Experience], group_sizes: list[int],
                  images: dict[str, bytes] | None = None) -> PutOutcome:
        """Store experiences; `group_sizes[i]` is the size of the group of `experiences[i]`.
        `images`: bytes by content hash of the images they refer to, stored once each; every
        image an experience refers to must be given or stored already."""

    @abstractmethod
    async def sample(self, num_groups: int, *, policy: str | None = None,
                     min_version: int | None = None, max_version: int | None = None,
                     lease_seconds: float | None = None, holder: str | None = None,
                     min_groups: int | None = None) -> Lease:
        """Lease `num_groups` ready groups, or raise `NotEnoughExperiences`; with `min_groups`,
        as many of them as are ready when that is at least `min_groups`."""

    @abstractmethod
    async def ack(self, lease_id: str, step: int | None = None,
                  more: Sequence[str] = ()) -> None:
        """The lease's groups (and those of the leases in `more`, in the same transaction) were
        trained on, by trainer step `step` when given."""

    @abstractmethod
    async def release(self, lease_id: str) -> None:
        """Give the lease's groups back unused."""

    @abstractmethod
    async def release_holder(self, holder: str) -> int:
        """Give back every lease `holder` holds; returns how many there were."""

    @abstractmethod
    async def rewind(self, step: int) -> RewindOutcome:
        """Undo every use acked with a step >= `step` and release every lease."""

    @abstractmethod
    async def checkpointed(self, step: int) -> None:
        """The trainer's newest checkpoint holds the steps below `step`."""

    @abstractmethod
    async def ready_groups(self, min_version: int | None = None,
                           max_version: int | None = None) -> int:
        """Ready groups within the version filter (no side effects besides lease expiry)."""

    @abstractmethod
    async def stats(self) -> BufferStats:
        """Counts by state and version, bytes, groups waiting and ready, dropped as stale."""

    @abstractmethod
    async def close(self) -> None:
        """Finish pending work and release the storage."""
