"""The `ExperienceStore` interface: what any durable store behind the buffer service promises.

Semantics (DESIGN §6), the same for every implementation:

- A group is all experiences with one `group_id` (one task under one policy version). It is
  *waiting* until it holds `group_size` experiences, then *ready*. Only ready groups are sampled,
  always whole.
- `put` is idempotent by experience id and returns only after the experiences are durable.
  A put that would push the unconsumed experiences past `capacity` fails with `BufferFull`
  (nothing of that batch is stored). Puts into a group already consumed count as duplicates;
  puts into a group dropped as stale are counted as stale and not stored.
- `sample` leases `num_groups` ready groups at once or none (`NotEnoughExperiences`). Before it
  chooses, ready and waiting groups below `min_version` are dropped as *stale*, permanently, and
  counted. Order: groups used fewer times first (replay only fills in), then the policy: `fifo`
  oldest version first, `newest` newest version first, `priority` highest priority first; ties
  by arrival.
- `ack(lease)` counts one use of each group; a group used `reuse` times is *consumed*, else ready
  again. `release(lease)` or the lease's expiry returns its groups to ready without a use. An
  expired lease is unknown: acking it fails with `UnknownLease`.
- Consumed and stale groups keep a small tombstone row forever (so late duplicates are still
  recognised); their experience rows are deleted beyond the newest `keep_consumed`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from tandem.common.errors import RequestFailed
from tandem.common.messages import BufferStats, Experience

STATES = ("waiting", "ready", "leased", "consumed", "stale")
POLICIES = ("fifo", "newest", "priority")


class BufferFull(RequestFailed):
    """The store holds `capacity` unconsumed experiences; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__("full", message, retry_after=retry_after)


class NotEnoughExperiences(RequestFailed):
    """Fewer ready groups than asked for (after the staleness filter)."""

    def __init__(self, have: int, need: int, dropped: int = 0, waited: float = 0.0):
        self.have = have
        self.need = need
        self.dropped = dropped  # experiences dropped as stale while trying
        detail = f", dropped {dropped} stale experiences" if dropped else ""
        if waited:
            detail += f", after waiting {waited:.1f} s"
        super().__init__(
            "not_enough", f"not enough experiences (have {have} ready groups, need {need}){detail}")


class UnknownLease(RequestFailed):
    """The lease was acked or released already, expired, or never existed."""

    def __init__(self, lease_id: str):
        super().__init__("unknown_lease", f"lease {lease_id!r} is unknown: already acked or "
                         "released, or it expired (buffer.lease_seconds) and its groups went back")


class BadPut(RequestFailed):
    """A put that contradicts what the store holds (group size, version, overflow)."""

    def __init__(self, message: str):
        super().__init__("bad_request", message)


@dataclass(slots=True)
class PutOutcome:
    """What a put did: newly stored, already there, and counted-not-stored as stale."""

    stored: int = 0
    duplicates: int = 0
    dropped_stale: int = 0


@dataclass(slots=True)
class Lease:
    """Whole groups handed out until `expires_at` (unix seconds)."""

    lease_id: str
    expires_at: float
    group_ids: list[str]
    experiences: list[Experience]
    dropped_stale: int = 0


class ExperienceStore(ABC):
    """A durable store of experiences with group sampling under leases (module docstring)."""

    @abstractmethod
    async def put(self, experiences: list[Experience], group_sizes: list[int]) -> PutOutcome:
        """Store experiences; `group_sizes[i]` is the size of the group of `experiences[i]`."""

    @abstractmethod
    async def sample(self, num_groups: int, *, policy: str | None = None,
                     min_version: int | None = None, max_version: int | None = None,
                     lease_seconds: float | None = None) -> Lease:
        """Lease `num_groups` ready groups, or raise `NotEnoughExperiences`."""

    @abstractmethod
    async def ack(self, lease_id: str) -> None:
        """The lease's groups were trained on."""

    @abstractmethod
    async def release(self, lease_id: str) -> None:
        """Give the lease's groups back unused."""

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
