"""Master protocol: registry, task leases, step reports, and the barrier events it publishes.

Requests go to the master's RPC (ROUTER) socket, `master.address`. Decisions go out on its PUB
socket (`Registered.publish_address`), each topic numbered, the newest event per topic served as
a snapshot (`SnapshotRequest` on the RPC socket) to anyone who joins late or reconnects:

| topic | message | for |
|---|---|---|
| `barrier.<explorer>.` | `Barrier` | that explorer: the step it may start and with which weights |
| `trainer` | `TrainerGo` | the trainer: the step it may train, the version to publish after it |
| `weights` | `WeightsPublished` | everyone: a version is ready (checkpoint path or nccl rendezvous) |
| `stop` | `Stop` | everyone: the run is over (each registered component answers `Goodbye` as it leaves) |

An explorer's loop: `Register` -> wait for `Barrier` -> load `version` if `wait` -> `LeaseTasks`
-> roll out -> `CompleteTasks` -> `ExplorerStepDone` (echoing step, batch, version) -> next
`Barrier`. In asynchronous plans an explorer may send `ExplorerDraining` once its step's tasks
are leased and a group is scored: the master may then grant its next step at once, and the
explorer leases and rolls it out while the first drains, reporting both in grant order. The trainer's: `Register` -> `TrainerResumed` -> wait for `TrainerGo` -> train -> `TrainerStepDone` ->
(when `publish` is set) write or broadcast the weights and send `WeightsPublished`. After each
checkpoint it sends `TrainerCheckpointed`; the master ends the run (after `Stop`) only once a
checkpoint holds every step it counted. Counting of
steps, batches and versions: `tandem.common.sync`.

The master's journal (`run_dir/master/journal.bin`) is a sequence of these same messages: every
accepted request that changes the run's state, plus the master's own decisions below
(`RunStarted`, `RunAmended`, `TasksLeased`, `TasksExhausted`, `LeaseExpired`, `ExplorerLeft`,
`StalenessSet`),
each encoded with `tandem.common.codec` and replayed through the handler that applied it live.
A compacted journal starts with `JournalSnapshot`, the state its earlier records built.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .base import Message, Ok, Request, wire
from .experience import Task
from .weights import GroupRendezvous

Role = Literal["explorer", "evaluator", "trainer", "buffer", "reward", "tool"]
Term = str | int | float | bool | None


def barrier_topic(explorer: str) -> str:
    """The PUB topic of one explorer's barriers. ZeroMQ subscriptions are prefixes, so the topic
    ends in a dot: `barrier.explorer-1.` does not also match `barrier.explorer-10.`."""
    return f"barrier.{explorer}."


@wire("master.register.reply")
class Registered(Message):
    """Master to a component: accepted; the run's identity and the heartbeat timing to keep."""

    run_id: str
    liveness: float = Field(gt=0, description="seconds of silence after which the master marks "
                                              "it dead (the master's `transport.liveness`)")
    heartbeat_interval: float = Field(gt=0, description="seconds between heartbeats when it is "
                                                        "otherwise silent")
    publish_address: str = Field(default="", description="the master's PUB socket, as bound")
    trainer_steps: int = Field(
        default=0, ge=0, description="trainer steps the master has counted (TrainerStepDone); a "
                                     "trainer resumes from a checkpoint at or below it")
    granted_step: int | None = Field(
        default=None, description="an explorer: the step of the batch it was granted and has not "
                                  "reported, which a restarted explorer rolls out again")
    granted_batch: int | None = Field(default=None, description="an explorer: that batch")
    reported_batch: int | None = Field(
        default=None, description="an explorer: the newest batch the master counted from it; a "
                                  "barrier up to it is stale and is never rolled out again")


@wire("master.register", reply=Registered)
class Register(Request):
    """Any component to master, on start and on reconnect: who I am, and what I believe the run
    is. The master refuses it (`config_mismatch`) when a term differs from its own config."""

    name: str
    role: Role
    address: str | None = Field(default=None, description="its RPC address, if it serves one")
    pid: int | None = None
    host: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)
    terms: dict[str, Term] = Field(
        default_factory=dict, description="config keys that change the run, as this component "
                                          "resolved them (`RunConfig.terms`)")


@wire("master.tasks.reply")
class TaskLease(Message):
    """Master to explorer: tasks to roll out, to be completed before `deadline` (unix seconds)."""

    lease_id: str
    tasks: list[Task]
    deadline: float
    exhausted: bool = Field(default=False, description="no tasks left; the run is ending")


@wire("master.tasks", reply=TaskLease)
class LeaseTasks(Request):
    """Explorer to master: lease `count` tasks for explorer step `step`."""

    explorer: str
    count: int = Field(ge=1)
    step: int = Field(ge=0)
    batch: int | None = Field(default=None, description="the barrier's batch: a batch already "
                                                        "reported is refused (`step_reported`)")


@wire("master.tasks.complete", reply=Ok)
class CompleteTasks(Request):
    """Explorer to master: the lease's experiences are acknowledged by the buffer."""

    lease_id: str


@wire("master.tasks.release", reply=Ok)
class ReleaseTasks(Request):
    """Explorer to master, when it stops mid-step: hand the lease's tasks to the next explorer
    now rather than when the lease expires."""

    lease_id: str
    reason: str = ""


@wire("master.explorer.step", reply=Ok)
class ExplorerStepDone(Request):
    """Explorer to master: explorer step `step` is in the buffer, rolled out with `version`.
    With `lease_id` it also completes the step's task lease, as a `CompleteTasks` sent just
    before it would: one round trip between the step's last put and the trainer's go, not two
    (issue 27 item 2)."""

    explorer: str
    step: int = Field(ge=0)
    version: int = Field(ge=0)
    batch: int | None = Field(default=None, ge=0, description="echo of `Barrier.batch`")
    lease_id: str | None = Field(default=None, description="the step's task lease, completed "
                                 "first (journaled as its own `CompleteTasks`)")
    experiences: int = 0
    informative: int | None = Field(
        default=None, ge=0, description="groups whose rewards are not all equal (dynamic sampling)")
    metrics: dict[str, float] = Field(default_factory=dict)


@wire("master.explorer.draining", reply=Ok)
class ExplorerDraining(Request):
    """Explorer to master, asynchronous plans: step `step` (batch `batch`) has all its tasks
    leased and a slot free. The master may grant the next step now (a `Barrier` as usual),
    which the explorer starts while this one drains; reports still come in grant order."""

    explorer: str
    step: int = Field(ge=0)
    batch: int = Field(ge=0)


@wire("master.trainer.step", reply=Ok)
class TrainerStepDone(Request):
    """Trainer to master: trainer step `step` is done; weights are at version `version`. With
    `published`, that version is also written and announced, as a `WeightsPublished` sent just
    after it would: the synchronous plans' path from the train's end to the explorer's barrier
    crosses one round trip, not two (issue 27 item 2)."""

    step: int = Field(ge=0)
    version: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    published: WeightsPublished | None = Field(
        default=None, description="a checkpoint version written with the step, announced after "
        "the count (journaled as its own `WeightsPublished`)")


@wire("master.trainer.resumed", reply=Ok)
class TrainerResumed(Request):
    """Trainer to master, after `Register`: the learner is at step `step` (its checkpoint holds
    steps 0..step-1; 0: none). The master's trainer count goes back to `step` and `TrainerGo` is
    released again from there, so the steps after the checkpoint are trained again."""

    step: int = Field(ge=0)
    checkpoint: str | None = Field(default=None, description="the checkpoint folder, if any")
    lineage: str = Field(default="", max_length=64,
                         description="this incarnation's lineage id (checkpoints, versions)")


@wire("master.trainer.checkpointed", reply=Ok)
class TrainerCheckpointed(Request):
    """Trainer to master: a checkpoint holding steps 0..step-1 is on disk. A run is done only
    once one holds every step the master counted (docs/reliability.md, "Nothing lost")."""

    step: int = Field(ge=0)
    checkpoint: str = Field(default="", description="the checkpoint folder")


@wire("master.weights", reply=Ok)
class WeightsPublished(Request):
    """Trainer to master (and master to all on topic `weights`): version `version` is ready."""

    version: int = Field(ge=0)
    method: Literal["checkpoint", "nccl"]
    path: str | None = Field(default=None, description="for checkpoint: the weights/v{N} folder, "
                             "or its /dev/shm segment (weights.transport: shared_memory)")
    rendezvous: GroupRendezvous | None = Field(default=None, description="nccl group to join")

    def on_disk(self) -> WeightsPublished:
        """Without the rendezvous, whose member key admits anyone to the weight group: a
        restarted master republishes the version without it, and members keep the group
        they are in (the trainer announces a new one when it opens one)."""
        return self.model_copy(update={"rendezvous": None}) if self.rendezvous else self


@wire("master.goodbye", reply=Ok)
class Goodbye(Request):
    """A registered component to master, its last call: it is leaving (after the `Stop`, or on a
    signal). After a `Stop` the master exits once every component alive in its registry said
    it, instead of serving `master.stop_grace` for those that heard the Stop; `Register` takes
    it back. Added without a version change: a master that predates it answers `bad_request`
    and the sender goes on leaving, as the master then waits out `stop_grace`."""

    name: str


@wire("master.barrier")
class Barrier(Message):
    """Master to one explorer (topic `barrier_topic(explorer)`): `step` may start with `version`."""

    explorer: str
    step: int = Field(description="the sync-plan step this batch counts as")
    version: int = Field(description="the weights to roll out with")
    wait: bool = Field(description="True at a sync point: load `version` before rolling out")
    batch: int = Field(default=0, description="the run-wide batch number (echo it when done)")
    method: Literal["checkpoint", "nccl"] = "checkpoint"
    sleep_after: bool = Field(
        default=False, description="placement.colocate: the trainer trains this step on the "
        "explorer's devices next, so its engine sleeps once the step is stored, before it is "
        "reported")


@wire("master.trainer.go")
class TrainerGo(Message):
    """Master to trainer (topic `trainer`): train step `step`; publish `publish` when done."""

    step: int
    publish: int | None = Field(default=None, description="the version to publish after it")
    publish_by: Literal["checkpoint"] | None = Field(
        default=None, description="publish it this way instead of sync.method: a version that "
        "a lost lineage broadcast, written to disk for explorers that restarted (nccl)")
    batches: int = Field(default=0, description="explorer batches this step trains on")
    groups: int | None = Field(
        default=None, description="tasks (= groups) in those batches, when the master knows")
    extra_batches: int = Field(
        default=0, description="top-up batches leased for this step (trainer.dynamic_sampling)")
    explorers: list[str] = Field(
        default_factory=list, description="explorers alive now (the nccl group for `publish`)")
    in_use: list[int] = Field(
        default_factory=list, description="versions explorers hold now; keep them on disk")


@wire("master.stop")
class Stop(Message):
    """Master to all (topic `stop`): the run is over (done, or failed with `reason`) at `steps`
    trainer steps counted. A trainer that resumed from a checkpoint holding fewer steps retrains
    them (its `TrainerResumed` re-opens the run), so a done Stop of more steps than it holds is
    not its own: one a restarted master re-sent before the resume reached it."""

    reason: str
    ok: bool = True
    steps: int | None = None

    def ends(self, trainer_steps: int) -> bool:
        """Whether this Stop ends a trainer whose learner holds `trainer_steps` steps: a
        failure always does; a done Stop of more steps than it holds does not."""
        return not self.ok or self.steps is None or self.steps <= trainer_steps


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanKnobs(_Report):
    """The sync plan the master runs (`SyncPlan.describe()`)."""

    method: Literal["checkpoint", "nccl"]
    interval: int
    offset: int | None
    max_staleness: int
    batches_per_step: int


class RunCounters(_Report):
    """The run's counters; the task ones are None when the master has no taskset."""

    plan: PlanKnobs
    total_steps: int
    trainer_steps_done: int
    trainer_steps_released: int
    newest_version: int
    batches_granted: int
    batches_done: int
    batches_lost: int
    explorers_alive: int
    stopped: bool
    tasks_total: int | None = None
    tasks_dispatched: int | None = None
    tasks_completed: int | None = None
    tasks_returned: int | None = None
    leases_open: int | None = None
    leases_expired: int | None = None
    epoch: int | None = None


class ComponentStatus(_Report):
    """One registered component and how long the master has not heard from it."""

    name: str
    role: Role
    alive: bool
    pid: int | None = None
    host: str | None = None
    address: str | None = None
    silent_for: float | None = Field(default=None, description="seconds; None: not watched now")


class RunningStep(_Report):
    """A step granted to an explorer and not reported yet."""

    step: int
    batch: int
    version: int


class ExplorerStatus(_Report):
    """One explorer as the run's clock sees it."""

    name: str
    alive: bool
    finished: bool = Field(description="the taskset ran dry on it")
    join_step: int
    running: RunningStep | None = None
    ahead: RunningStep | None = Field(
        default=None, description="asynchronous: the next step, granted while `running` drains")
    steps_done: int
    held_version: int | None = None
    staleness: int | None = Field(default=None, description="trainer steps done - held version")
    behind_newest: int | None = Field(default=None, description="newest version - held version")


class LeaseStatus(_Report):
    """One open task lease."""

    lease_id: str
    explorer: str
    step: int
    tasks: int
    deadline: float = Field(description="unix seconds")
    granted_at: float = Field(description="unix seconds")


@wire("master.status.reply")
class Status(Message):
    """Master to anyone: registry, counters, versions, staleness and leases."""

    run_id: str
    counters: RunCounters
    components: list[ComponentStatus] = Field(default_factory=list)
    explorers: list[ExplorerStatus] = Field(default_factory=list)
    leases: list[LeaseStatus] = Field(default_factory=list)


@wire("master.status", reply=Status)
class GetStatus(Request):
    """Anyone (`tandem status`) to master: report."""


# -- the master's own decisions, as its journal records them ------------------------------------


@wire("master.journal.started")
class RunStarted(Message):
    """Master to its journal, first record: the run this journal belongs to."""

    run_id: str
    total_steps: int = Field(ge=1)
    plan: PlanKnobs
    config: dict[str, Any] | None = Field(
        default=None, description="the run's config, resolved, secrets as ${env:...} "
                                  "references (tandem.common.runrecord); None in older journals")


@wire("master.journal.snapshot")
class JournalSnapshot(Message):
    """Master to its journal, first record of a compacted journal: the state that replaying
    records 1..`records` built (docs/master.md, "Compaction"); the records after it follow."""

    records: int = Field(ge=1, description="the records this snapshot stands for")
    format: int = Field(ge=1, description="the layout of `state` (tandem.master.snapshot)")
    run_id: str
    total_steps: int = Field(ge=1)
    config: dict[str, Any] | None = None
    trainer_steps: int = Field(ge=0, description="trainer steps counted")
    state: dict[str, Any]


@wire("master.journal.amended")
class RunAmended(Message):
    """Master to its journal: the run goes on, after a `--resume`, under this config and length
    (only keys that may change on resume changed: tandem.common.runrecord.RESUMABLE)."""

    total_steps: int = Field(ge=1)
    config: dict[str, Any]


@wire("master.journal.awaiting_trainer")
class AwaitingTrainer(Message):
    """Master to its journal: `awaiting`: it restarted with versions published, and grants no
    barrier until the trainer shows which lineage goes on (a resumed trainer moves the lost
    one's versions aside); not `awaiting`: the trainer did (a heartbeat, a step, a version)."""

    awaiting: bool


@wire("master.journal.staleness")
class StalenessSet(Message):
    """Master to its journal (and trace): with `sync.max_staleness: auto`, the metrics of the
    trainer's step `step` moved the staleness bound from `previous` to `bound`; grants from here
    on use it (tandem.common.staleness)."""

    step: int = Field(ge=0)
    bound: int = Field(ge=0)
    previous: int = Field(ge=0)
    action: Literal["widen", "narrow"]
    metric: str
    value: float = Field(description="the mean of the metric over the values judged")
    why: str = ""


@wire("master.journal.leased")
class TasksLeased(Message):
    """Master to its journal: a `LeaseTasks` was answered with these tasks (taskset refs as
    (epoch, row) pairs), due back before `deadline` (unix seconds)."""

    lease_id: str
    explorer: str
    step: int = Field(ge=0)
    refs: list[tuple[int, int]] = Field(min_length=1)
    deadline: float
    granted_at: float


@wire("master.journal.exhausted")
class TasksExhausted(Message):
    """Master to its journal: a `LeaseTasks` from `explorer` found the taskset empty."""

    explorer: str


@wire("master.journal.expired")
class LeaseExpired(Message):
    """Master to its journal: a lease passed its deadline; its tasks go back in the queue."""

    lease_id: str


@wire("master.journal.left")
class ExplorerLeft(Message):
    """Master to its journal: `explorer` was silent past `transport.liveness`; its running batch
    is given up and its leases go back in the queue."""

    explorer: str
