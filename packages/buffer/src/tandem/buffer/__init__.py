"""tandem-buffer: the durable experience store the explorers fill and the trainer samples.

- `ExperienceStore`: the store interface and its semantics (groups, leases, staleness, replay,
  rewind), and the typed errors its operations raise.
- `SqliteStore`: the embedded default, one SQLite file in WAL mode, written by one
  `GroupCommitWriter` thread, its finished rows deleted by a `Pruner`.
- `Buffer`: the RPC service around a store (`await Buffer(config).serve()`), CLI `tandem-buffer`;
  it maps the store's errors to reply codes (`REPLY_CODES`).
"""

from .policy import group_priority
from .pruner import Pruner
from .service import REPLY_CODES, Buffer
from .sqlite import SqliteStore
from .store import (
    BadPut, BufferFull, ExperienceStore, Lease, NotEnoughExperiences, PutOutcome, RewindOutcome,
    RewindTooFar, StoreError, UnknownLease,
)
from .writer import GroupCommitWriter, StoreClosed

__all__ = [
    "REPLY_CODES",
    "BadPut",
    "Buffer",
    "BufferFull",
    "ExperienceStore",
    "GroupCommitWriter",
    "Lease",
    "NotEnoughExperiences",
    "Pruner",
    "PutOutcome",
    "RewindOutcome",
    "RewindTooFar",
    "SqliteStore",
    "StoreClosed",
    "StoreError",
    "UnknownLease",
    "group_priority",
]
