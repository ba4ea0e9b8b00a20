"""The master's state as one journal record (`JournalSnapshot`), and back.

A snapshot holds exactly what the journal's records build when they are replayed through the
master's apply methods: the run's record, the registry, the `RunClock`, the taskset's cursor
and leases, the lease bookkeeping per explorer and step, the staleness bound's state, the
newest checkpoint and version. What comes from the config (the taskset's rows, the plan's
knobs, the sockets) is not in it: the restarting master has those, and checks the plan against
the snapshot's as replay checks it against `RunStarted`'s.

`state` is a msgpack map written by pydantic from the same dataclasses the master uses
(`TypeAdapter`), so a field added to them changes the layout: raise `FORMAT`, and keep reading
the older layout (or refuse it in one line, as below for a newer one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from tandem.common.messages.master import (
    JournalSnapshot,
    PlanKnobs,
    Role,
    RunStarted,
    WeightsPublished,
)
from tandem.common.runrecord import RunRecord
from tandem.common.staleness import StalenessState

from .clock import RunClock
from .journal import JournalError
from .taskset import Lease

if TYPE_CHECKING:
    from .service import Master

FORMAT = 1


@dataclass
class Registration:
    """One component in the master's registry, as its `Register` said (kept in a snapshot)."""

    name: str
    role: Role
    address: str | None = None
    pid: int | None = None
    host: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    alive: bool = True




class TasksState(BaseModel):
    """`TaskDispatcher`'s state (its rows and config come from the config)."""

    cursor: int
    returned: list[tuple[int, int]]
    leases: dict[str, Lease]
    completed: int
    expired: int
    late: dict[str, list[tuple[int, int]]]
    done_ids: list[str]


class MasterState(BaseModel):
    """Everything the journal's records build, bar the run record (`JournalSnapshot`'s own)."""

    plan: PlanKnobs  # RunStarted's: a master with another plan refuses the run dir
    registry: list[dict[str, Any]]  # `Registration` fields
    clock: RunClock
    tasks: TasksState | None
    lease_sizes: list[tuple[str, int, int]]  # (explorer, step, tasks)
    step_leases: list[tuple[str, int, str]]  # (explorer, step, lease id)
    staleness: StalenessState | None
    trainer_checkpoint: int
    last_weights: WeightsPublished | None
    weights_events: int


def capture(master: Master) -> JournalSnapshot:
    """The snapshot of `master` after its journal's last record."""
    record, tasks = master._run_record, master.dispatcher
    state = MasterState(
        plan=PlanKnobs(**master.plan.describe()),
        registry=[asdict(reg) for reg in master.registry.values()],
        clock=master.clock,
        tasks=None if tasks is None else TasksState(
            cursor=tasks.cursor, returned=list(tasks.returned), leases=tasks.leases,
            completed=tasks.completed, expired=tasks.expired, late=tasks.late,
            done_ids=list(tasks.done_ids)),
        lease_sizes=[(e, s, n) for (e, s), n in master._lease_sizes.items()],
        step_leases=[(e, s, lease) for (e, s), lease in master._step_leases.items()],
        staleness=master.staleness, trainer_checkpoint=master.trainer_checkpoint,
        last_weights=None if master._last_weights is None else master._last_weights.on_disk(),
        weights_events=master._weights_events)
    return JournalSnapshot(
        records=master.journal.records, format=FORMAT, run_id=record.run_id,
        total_steps=record.total_steps, config=record.config,
        trainer_steps=master.clock.trainer_done, state=state.model_dump(mode="json"))


def restore(master: Master, snap: JournalSnapshot, where: str) -> None:
    """Set `master`'s state to `snap`'s, as replaying the records it stands for would."""
    if snap.format > FORMAT:
        raise JournalError(f"{where}: a snapshot of format {snap.format}, newer than this "
                           f"tandem reads ({FORMAT}); resume the run with the tandem that "
                           "wrote it")
    try:
        state = MasterState.model_validate(snap.state)
    except ValidationError as exc:
        raise JournalError(f"{where}: the snapshot does not read back "
                           f"({exc.error_count()} errors, first: {exc.errors()[0]['loc']}); "
                           "the journal is damaged") from None
    # the same checks as replaying RunStarted: the plan, and a length that only goes up
    master._apply_started(RunStarted(run_id=snap.run_id, total_steps=snap.total_steps,
                                     plan=state.plan, config=snap.config))
    master._run_record = RunRecord(snap.run_id, snap.total_steps, snap.config)
    master.registry = {reg["name"]: Registration(**reg) for reg in state.registry}
    clock = state.clock
    clock.extend(master.clock.total_steps)  # a --resume that made the run longer
    master.clock = clock
    if state.tasks is not None:
        if master.dispatcher is None:
            raise JournalError(f"{where}: the run leased tasks but this master has no taskset; "
                               "set master.taskset.path as the run did")
        tasks = master.dispatcher
        t = state.tasks
        tasks.cursor, tasks.completed, tasks.expired = t.cursor, t.completed, t.expired
        tasks.returned.clear()
        tasks.returned.extend(t.returned)
        tasks.leases, tasks.late = t.leases, t.late
        tasks.done_ids = dict.fromkeys(t.done_ids)
    master._lease_sizes = {(e, s): n for e, s, n in state.lease_sizes}
    master._step_leases = {(e, s): lease for e, s, lease in state.step_leases}
    master.staleness = state.staleness
    master.trainer_checkpoint = state.trainer_checkpoint
    master._last_weights = state.last_weights
    master._weights_events = state.weights_events


__all__ = ["FORMAT", "MasterState", "capture", "restore"]
