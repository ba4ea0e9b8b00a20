"""Master protocol: registry, task leases, step reports, and the barrier events it publishes.

Requests go to the master's RPC (ROUTER) socket, `master.address`. Decisions go out on its PUB
socket (`Registered.publish_address`), each topic numbered, the newest event per topic served as
a snapshot (`SnapshotRequest` on the RPC socket) to anyone who joins late or reconnects:

| topic | message | for |
|---|---|---|
| `barrier.<explorer>.` | `Barrier` | that explorer: the step it may start and with which weights |
| `trainer` | `TrainerGo` | the trainer: the step it may train, the version to publish after it |
| `weights` | `WeightsPublished` | everyone: a version is ready (checkpoint path or nccl rendezvous) |
| `stop` | `Stop` | everyone: the run is over |

An explorer's loop: `Register` -> wait for `Barrier` -> load `version` if `wait` -> `LeaseTasks`
-> roll out -> `CompleteTasks` -> `ExplorerStepDone` (echoing step, batch, version) -> next
`Barrier`. The trainer's: `Register` -> wait for `TrainerGo` -> train -> `TrainerStepDone` ->
(when `publish` is set) write or broadcast the weights and send `WeightsPublished`. Counting of
steps, batches and versions: `tandem.common.sync`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import Message, Ok, Request, wire
from .experience import Task

Role = Literal["explorer", "trainer", "buffer", "reward", "tool"]


def barrier_topic(explorer: str) -> str:
    """The PUB topic of one explorer's barriers. ZeroMQ subscriptions are prefixes, so the topic
    ends in a dot: `barrier.explorer-1.` does not also match `barrier.explorer-10.`."""
    return f"barrier.{explorer}."


@wire("master.register.reply")
class Registered(Message):
    """Master to a component: accepted; the run's identity and the resolved sync knobs."""

    run_id: str
    sync: dict[str, Any] = Field(description="the resolved `sync` config section")
    liveness: float = Field(description="seconds of silence after which the master marks it dead")
    publish_address: str = Field(default="", description="the master's PUB socket, as bound")


@wire("master.register", reply=Registered)
class Register(Request):
    """Any component to master, on start and on reconnect: who I am."""

    name: str
    role: Role
    address: str | None = Field(default=None, description="its RPC address, if it serves one")
    pid: int | None = None
    host: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


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
    """Explorer to master: explorer step `step` is in the buffer, rolled out with `version`."""

    explorer: str
    step: int = Field(ge=0)
    version: int = Field(ge=0)
    batch: int | None = Field(default=None, ge=0, description="echo of `Barrier.batch`")
    experiences: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)


@wire("master.trainer.step", reply=Ok)
class TrainerStepDone(Request):
    """Trainer to master: trainer step `step` is done; weights are at version `version`."""

    step: int = Field(ge=0)
    version: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)


@wire("master.weights", reply=Ok)
class WeightsPublished(Request):
    """Trainer to master (and master to all on topic `weights`): version `version` is ready."""

    version: int = Field(ge=0)
    method: Literal["checkpoint", "nccl"]
    path: str | None = Field(default=None, description="weights/v{N} folder, for checkpoint")
    rendezvous: dict[str, Any] | None = Field(default=None, description="nccl group to join")


@wire("master.barrier")
class Barrier(Message):
    """Master to one explorer (topic `barrier_topic(explorer)`): `step` may start with `version`."""

    explorer: str
    step: int = Field(description="the sync-plan step this batch counts as")
    version: int = Field(description="the weights to roll out with")
    wait: bool = Field(description="True at a sync point: load `version` before rolling out")
    batch: int = Field(default=0, description="the run-wide batch number (echo it when done)")
    method: Literal["checkpoint", "nccl"] = "checkpoint"


@wire("master.trainer.go")
class TrainerGo(Message):
    """Master to trainer (topic `trainer`): train step `step`; publish `publish` when done."""

    step: int
    publish: int | None = Field(default=None, description="the version to publish after it")
    batches: int = Field(default=0, description="explorer batches this step trains on")
    groups: int | None = Field(
        default=None, description="tasks (= groups) in those batches, when the master knows")
    explorers: list[str] = Field(
        default_factory=list, description="explorers alive now (the nccl group for `publish`)")
    in_use: list[int] = Field(
        default_factory=list, description="versions explorers hold now; keep them on disk")


@wire("master.stop")
class Stop(Message):
    """Master to all (topic `stop`): the run is over (done, or failed with `reason`)."""

    reason: str
    ok: bool = True


@wire("master.status.reply")
class Status(Message):
    """Master to anyone: registry, counters, versions, staleness and leases."""

    run_id: str
    components: list[dict[str, Any]]
    counters: dict[str, Any]
    leases: list[dict[str, Any]]
    explorers: list[dict[str, Any]] = Field(
        default_factory=list, description="per explorer: step, held version, staleness")


@wire("master.status", reply=Status)
class GetStatus(Request):
    """Anyone (`tandem status`) to master: report."""
