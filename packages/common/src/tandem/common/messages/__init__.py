"""Every wire message of tandem, one module per protocol; read these files to learn it.

- `base`: the envelope-level messages (ok, heartbeat, pub/sub snapshot) and array fields.
- `experience`: the experience and the task (DESIGN §3).
- `buffer`, `master`, `reward`: each service's requests, replies and published events.
- `weights`: the broadcast group's rendezvous and per-version tensor layout (`tandem.common.weights`).
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
    GetBufferStats,
    PutExperiences,
    PutResult,
    ReleaseLease,
    SampleGroups,
    SampleResult,
)
from .experience import Experience, Task, experience_id, group_id
from .master import (
    Barrier,
    CompleteTasks,
    ExplorerStepDone,
    GetStatus,
    LeaseTasks,
    Register,
    Registered,
    ReleaseTasks,
    Status,
    Stop,
    TaskLease,
    TrainerGo,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from .reward import GetRewardStats, RewardStats, Score, ScoreBatch, ScoreItem, Scores

__all__ = [name for name in dir() if not name.startswith("_")]
