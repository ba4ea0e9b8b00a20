"""Master protocol: registry, task leases, step reports, and the barrier events it publishes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import Message, Ok, Request, wire
from .experience import Task

Role = Literal["explorer", "trainer", "buffer", "reward", "tool"]


@wire("master.register.reply")
class Registered(Message):
    """Master to a component: accepted; the run's identity and the resolved sync knobs."""

    run_id: str
    sync: dict[str, Any] = Field(description="the resolved `sync` config section")
    liveness: float = Field(description="seconds of silence after which the master marks it dead")


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


@wire("master.explorer.step", reply=Ok)
class ExplorerStepDone(Request):
    """Explorer to master: explorer step `step` is in the buffer, rolled out with `version`."""

    explorer: str
    step: int = Field(ge=0)
    version: int = Field(ge=0)
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
    """Master to explorers (topic `barrier.<explorer>`): step `step` may start with `version`."""

    explorer: str
    step: int
    version: int
    wait: bool = Field(description="True at a sync point: load `version` before rolling out")


@wire("master.trainer.go")
class TrainerGo(Message):
    """Master to trainer (topic `trainer`): train step `step`; publish `publish` when done."""

    step: int
    publish: int | None = Field(default=None, description="the version to publish after it")


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


@wire("master.status", reply=Status)
class GetStatus(Request):
    """Anyone (`tandem status`) to master: report."""
