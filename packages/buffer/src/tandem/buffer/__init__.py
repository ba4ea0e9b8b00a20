"""tandem-buffer: the durable experience store the explorers fill and the trainer samples.

- `ExperienceStore`: the store interface and its semantics (groups, leases, staleness, replay).
- `SqliteStore`: the embedded default, one SQLite file in WAL mode with group commit.
- `Buffer`: the RPC service around a store (`await Buffer(config).serve()`), CLI `tandem-buffer`.
"""

from .policy import group_priority
from .service import Buffer
from .sqlite import SqliteStore, StoreClosed
from .store import (
    BadPut, BufferFull, ExperienceStore, Lease, NotEnoughExperiences, PutOutcome, UnknownLease,
)

__all__ = [
    "BadPut", "Buffer", "BufferFull", "ExperienceStore", "Lease", "NotEnoughExperiences",
    "PutOutcome", "SqliteStore", "StoreClosed", "UnknownLease", "group_priority",
]
