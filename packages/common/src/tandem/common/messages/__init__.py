"""Every wire message of tandem, one module per protocol; read these files to learn it.

- `base`: the envelope-level messages (ok, heartbeat, pub/sub snapshot) and array fields.
- `experience`: the experience and the task (docs/design.md §3).
- `buffer`, `master`, `reward`: each service's requests, replies and published events (`master`
  also holds its status models and the master's own journal records).
- `weights`: the broadcast group's rendezvous and per-version tensor layout (`tandem.weights`).
"""

from .base import (
    PROTOCOL_VERSION,
    REGISTRY,
    Array,
    ErrorInfo,
    Heartbeat,
    HeartbeatAck,
    Message,
    Ok,
    Request,
    SnapshotEntry,
    SnapshotReply,
    SnapshotRequest,
    wire,
)
from .buffer import (
    AckLease,
    BufferStats,
    CheckpointSaved,
    GetBufferStats,
    LeasesReleased,
    PutExperiences,
    PutResult,
    ReleaseLease,
    ReleaseLeases,
    RewindTo,
    Rewound,
    SampleGroups,
    SampleResult,
)
from .experience import Experience, Task, experience_id, group_id
from .master import (
    Barrier,
    CompleteTasks,
    ComponentStatus,
    ExplorerDraining,
    ExplorerLeft,
    ExplorerStatus,
    ExplorerStepDone,
    GetStatus,
    Goodbye,
    JournalSnapshot,
    LeaseExpired,
    LeaseStatus,
    LeaseTasks,
    PlanKnobs,
    Register,
    Registered,
    ReleaseTasks,
    RunAmended,
    RunCounters,
    RunningStep,
    RunStarted,
    StalenessSet,
    Status,
    Stop,
    TaskLease,
    TasksExhausted,
    TasksLeased,
    TrainerGo,
    TrainerCheckpointed,
    TrainerResumed,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from .reward import GetRewardStats, RewardStats, Score, ScoreBatch, ScoreItem, Scores

__all__ = [name for name in dir() if not name.startswith("_")]
