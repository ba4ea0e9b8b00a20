"""The master service: registry and liveness, task leases, step reports, barrier decisions.

`Master(config)` serves the master protocol (`tandem.common.messages.master`) on
`master.address` and publishes decisions on `master.publish_address`. All run state lives in
the registry, a `RunClock` (barriers) and a `TaskDispatcher` (leases), and changes in one way
only: a message (an accepted request, or one of the master's own decisions such as
`TasksLeased`) goes through its apply method and is appended to the journal before the
decisions it unlocks go out. A restarted master replays the journal through the same apply
methods and carries on; components that kept running simply reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import structlog

from tandem.common.config import RunConfig
from tandem.common.config.placement import colocated_explorer, evaluates_at_end
from tandem.common.errors import ConfigError, RequestFailed, TandemError
from tandem.common.heartbeat import Liveness
from tandem.common.messages.base import Heartbeat, HeartbeatAck, Message, Ok
from tandem.common.messages.master import (
    AwaitingTrainer,
    CompleteTasks,
    ComponentStatus,
    ExplorerDraining,
    ExplorerLeft,
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
    RunCounters,
    RunAmended,
    RunStarted,
    StalenessSet,
    Status,
    TaskLease,
    TrainerCheckpointed,
    TasksExhausted,
    TasksLeased,
    TrainerResumed,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from tandem.common.metrics import MetricsEndpoint
from tandem.common.pubsub import Publisher
from tandem.common.rpc import CallContext, RpcServer
from tandem.common.runrecord import RunRecord, check_against, recorded_config
from tandem.common.staleness import StalenessRule, StalenessState
from tandem.common.sync import SyncPlan
from tandem.common.trace import Tracer

from .clock import DeclaredDead, Decision, RunClock, StepMismatch
from .journal import Journal, JournalError, final_status_path
from .snapshot import Registration, capture, restore
from .taskset import TaskDispatcher, load_rows

log = structlog.get_logger(__name__)


def connectable(address: str | None) -> str:
    """The PUB address as a client may connect to it, for `Registered.publish_address`: "" when
    it is bound to every interface (0.0.0.0, ::, *), where the client's own
    `master.publish_address` names this host (connecting to 0.0.0.0 reaches the client's own)."""
    host = (address or "").split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return "" if host in ("", "0.0.0.0", "::", "*") else str(address)


def total_steps_for(config: RunConfig, dispatcher: TaskDispatcher | None) -> int:
    """`master.total_steps`, or as many steps as the taskset fills."""
    if config.master.total_steps is not None:
        return config.master.total_steps
    if dispatcher is None:
        raise ConfigError(["master: the run needs a length; set master.total_steps or "
                           "master.taskset.path"])
    per_step = sum(e.batch_size for e in config.rollout_explorers)
    steps = dispatcher.total // per_step
    if steps < 1:
        raise ConfigError([f"master.taskset: {dispatcher.total} tasks (x epochs) fill no step of "
                           f"{per_step} tasks (sum of explorers[*].batch_size)"])
    return steps


def _show(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


class Master:
    """The run's clock as a component: `await Master(config).serve()`."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.run_dir = Path(config.run_dir)
        cfg = config.master
        # an eval explorer (`role: eval`) registers as an evaluator: never in the plan or clock
        self.plan = SyncPlan.from_config(config.sync,
                                         batches_per_step=len(config.rollout_explorers))
        self.dispatcher = (TaskDispatcher(load_rows(cfg.taskset), cfg.taskset)
                           if cfg.taskset.path else None)
        self.total_steps = total_steps_for(config, self.dispatcher)
        tc = config.trainer
        # dynamic sampling: top up synchronous steps to groups_per_step informative groups
        self.clock = RunClock(self.plan, self.total_steps,
                              top_up_target=tc.groups_per_step if tc.dynamic_sampling else None,
                              max_extra=tc.max_oversample,
                              colocated=colocated_explorer(config),
                              keep_checkpoints=tc.keep_checkpoints,
                              colocated_sleeps_last=not evaluates_at_end(
                                  config, colocated_explorer(config)))
        # sync.max_staleness: auto: the rule, and the bound with what was measured under it
        self.staleness_rule: StalenessRule | None = (
            config.sync.auto.rule() if config.sync.auto_staleness else None)
        self.staleness: StalenessState | None = (
            None if self.staleness_rule is None else self.staleness_rule.initial())
        self._metric_missing_logged = False
        self.tracer = Tracer(self.run_dir if self.staleness_rule is not None
                             and config.logging.trace else None, "master")
        self.registry: dict[str, Registration] = {}
        self.liveness = Liveness(config.transport.liveness)
        self.journal = Journal(self.run_dir / cfg.journal,
                               compact_bytes=cfg.journal_compact_bytes)
        self.run_id = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.server = RpcServer(cfg.address, name="master", transport=config.transport)
        self.publisher = Publisher(cfg.publish_address, name="master",
                                   transport=config.transport)
        self.address: str | None = None
        self.publish_address: str | None = None
        self.resumed = False
        self._run_record: RunRecord | None = None  # the run as the journal records it
        self._last_weights: WeightsPublished | None = None
        self._weights_events = 0
        self._peers: dict[str, str] = {}  # RPC identity -> component name
        self._trainer_peer: str | None = None  # the RPC identity that registered as trainer
        self._lease_sizes: dict[tuple[str, int], int] = {}  # (explorer, step) -> tasks leased
        self._step_leases: dict[tuple[str, int], str] = {}  # (explorer, step) -> lease id
        self._loop_task: asyncio.Task | None = None
        self._done = asyncio.Event()  # set: serve() returns (run done, or request_stop())
        self._ending: asyncio.Task | None = None  # after a Stop: grace, then the checkpoint
        self._failure: TandemError | None = None  # why the run ended without its checkpoint
        self.trainer_checkpoint = 0  # steps the trainer's newest reported checkpoint holds
        self._checkpointed = asyncio.Event()  # set: a checkpoint holds every step counted
        self.awaiting_checkpoint = False  # the Stop's grace is over and that checkpoint is not
        self._goodbyes: set[str] = set()  # registered components that said they are leaving
        self._all_left = asyncio.Event()  # set: every component alive in the registry did
        self.ended_by: str | None = None  # what ended the Stop's grace: "goodbyes", "stop_grace"
        self._closed = False
        self._lock = asyncio.Lock()
        # The one way state changes: live (after the handler's checks) and on journal replay.
        self._appliers: dict[type[Message], Callable[[Any], list[Decision]]] = {
            RunStarted: self._apply_started, RunAmended: self._apply_amended,
            Register: self._apply_register,
            TasksLeased: self._apply_leased, TasksExhausted: self._apply_exhausted,
            CompleteTasks: self._apply_complete, ReleaseTasks: self._apply_release,
            LeaseExpired: self._apply_expired, ExplorerLeft: self._apply_left,
            ExplorerStepDone: self._apply_explorer_step, TrainerStepDone: self._apply_trainer_step,
            ExplorerDraining: self._apply_explorer_draining,
            TrainerResumed: self._apply_trainer_resumed,
            TrainerCheckpointed: self._apply_trainer_checkpointed,
            WeightsPublished: self._apply_weights,
            AwaitingTrainer: self._apply_awaiting,
            StalenessSet: self._apply_staleness,
        }
        for msg_type, handler in ((Register, self._on_register), (Heartbeat, self._on_heartbeat),
                                  (LeaseTasks, self._on_lease), (CompleteTasks, self._on_complete),
                                  (ReleaseTasks, self._on_release),
                                  (ExplorerStepDone, self._on_explorer_step),
                                  (ExplorerDraining, self._on_explorer_draining),
                                  (TrainerStepDone, self._on_trainer_step),
                                  (TrainerResumed, self._on_trainer_resumed),
                                  (TrainerCheckpointed, self._on_trainer_checkpointed),
                                  (WeightsPublished, self._on_weights),
                                  (Goodbye, self._on_goodbye),
                                  (GetStatus, self._on_status)):
            self.server.register(msg_type, handler)
        self.publisher.serve_snapshots(self.server)
        self.metrics = MetricsEndpoint(config.logging.metrics, "master", run_dir=self.run_dir)
        self.metrics.gauge_fn("clock", "the run clock's counters (steps, versions, batches)",
                              lambda: {k: float(v) for k, v in self.clock.counters().items()
                                       if v is not None}, labels=("counter",))
        self._m_dead = self.metrics.counter(
            "heartbeat_misses", "components declared dead: silent past transport.liveness",
            labels=("role",))
        self._m_leases_expired = self.metrics.counter(
            "task_leases_expired", "task leases that passed their deadline", labels=("why",))
        self.metrics.rpc_errors(self.server)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> str:
        """Replay the journal, bind both sockets, republish the current state; returns the RPC
        address as bound."""
        if self.address is not None:
            return self.address
        self._replay()
        self.journal.open()
        if not self.resumed:
            self._commit(RunStarted(run_id=self.run_id, total_steps=self.total_steps,
                                    plan=PlanKnobs(**self.plan.describe()),
                                    config=recorded_config(self.config)))
        else:
            self._amend()
        if self.resumed and self.clock.newest > 0 and not self.clock.stopped:
            # the trainer may resume from an older checkpoint and set newer versions aside:
            # no grant names one before it shows which lineage goes on
            self._commit(AwaitingTrainer(awaiting=True))
        self.publish_address = await self.publisher.start()
        self.address = await self.server.start()
        self.metrics.start()
        await self._republish()
        self._loop_task = asyncio.create_task(self._watch(), name="master-watch")
        log.info("master.started", address=self.address, publish=self.publish_address,
                 run_id=self.run_id, resumed=self.resumed, total_steps=self.total_steps,
                 plan=self.plan.describe())
        return self.address

    async def serve(self) -> None:
        """Serve until the run is done (plus `master.stop_grace`) or `request_stop()`; the
        caller then calls `close()`. The run is done once a trainer checkpoint holds every
        step counted; raises `TandemError` if none came within `master.final_checkpoint_wait`."""
        await self.start()
        await self._done.wait()
        if self._failure is not None:
            raise self._failure

    def request_stop(self) -> None:
        """Make `serve()` return (from a signal handler or another task), even before it ran."""
        self._done.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._done.set()
        for task in (self._loop_task, self._ending):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.server.close()
        await self.publisher.close()
        self.metrics.close()
        if self.address is not None:
            self._write_final_status()
        self.journal.close()
        self.tracer.close()
        log.info("master.closed", run_id=self.run_id, **self.clock.counters())

    def _write_final_status(self) -> None:
        """The status as this master leaves it, in `final_status_path` beside the journal:
        whoever asked for it last (`tandem up`) may not have asked after the Stop, and once
        every component said Goodbye the master does not wait to be asked."""
        path = final_status_path(self.journal.path)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(self.status().model_dump_json())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("master.status_unwritten", path=str(path), error=str(exc))

    # -- state changes: one apply method per message, shared by the handlers and the replay ----

    def _commit(self, msg: Message) -> list[Decision]:
        """Apply `msg` and journal it; returns the decisions to publish. The apply methods raise
        before they change anything, so a refused message leaves no trace."""
        decisions = self._appliers[type(msg)](msg)
        self.journal.append(msg)
        if self.journal.compaction_due:
            self.journal.compact(capture(self))
        return decisions

    def _replay(self) -> None:
        path = self.journal.path
        for number, msg in self.journal.replay():
            if isinstance(msg, JournalSnapshot):  # first, standing for records 1..number
                restore(self, msg, f"{path} snapshot of records 1..{number}")
                continue
            where = f"{path} record {number}"
            apply = self._appliers.get(type(msg))
            if apply is None:
                raise JournalError(f"{where}: {msg.TYPE!r} changes no state of the master and "
                                   "is not a journal record; the journal is damaged")
            if (number == 1) != isinstance(msg, RunStarted):
                raise JournalError(f"{where}: {msg.TYPE!r} where a journal has "
                                   f"{RunStarted.TYPE!r} {'first' if number == 1 else 'once'}")
            try:
                apply(msg)
            except (StepMismatch, KeyError, ValueError, RequestFailed) as exc:
                raise JournalError(f"{where} ({msg.TYPE}): {exc}; the journal does not replay "
                                   "to a consistent state") from None
        if self.journal.records:
            self.resumed = True
            now = time.monotonic()
            for name, reg in self.registry.items():
                if reg.alive:
                    self.liveness.touch(name, now)  # give everyone a full liveness to reconnect
            log.info("master.resumed", records=self.journal.records, **self.clock.counters())

    def _apply_started(self, msg: RunStarted) -> list[Decision]:
        plan = PlanKnobs(**self.plan.describe())
        if msg.plan != plan:
            raise ConfigError([
                f"run_dir: {self.run_dir} holds the journal of run {msg.run_id} with sync "
                f"plan {msg.plan.model_dump()}, not {plan.model_dump()}; resume it with the same "
                "sync section and explorers, or give this run a new run_dir"])
        self.run_id = msg.run_id
        return self._run_goes_on(msg.total_steps, msg.config)

    def _apply_amended(self, msg: RunAmended) -> list[Decision]:
        return self._run_goes_on(msg.total_steps, msg.config)

    def _run_goes_on(self, total_steps: int, config: dict[str, Any] | None) -> list[Decision]:
        """The journal's length and config of the run (`RunStarted`, then each `RunAmended`)."""
        if self.total_steps < total_steps:  # its explorers may have run past the new end
            raise ConfigError([
                f"master.total_steps: {self.total_steps} is below the {total_steps} steps of "
                f"run {self.run_id} in {self.run_dir}; a run's length may only go up on "
                "resume (give a new run a new run_dir)"])
        self._run_record = RunRecord(self.run_id, total_steps, config)
        return []

    def _amend(self) -> None:
        """A resumed run goes on under the journal's config, or (`--resume`) under one that
        changed only keys that may change on resume, which is then recorded (`RunAmended`)."""
        joined = check_against(self._run_record, self.config, resume=True)
        if joined.changed:
            log.info("master.run_amended", changed=[str(d) for d in joined.changed])
            self._commit(RunAmended(total_steps=self.total_steps,
                                    config=recorded_config(self.config)))

    def _apply_register(self, msg: Register) -> list[Decision]:
        self.registry[msg.name] = Registration(
            name=msg.name, role=msg.role, address=msg.address, pid=msg.pid, host=msg.host,
            meta=msg.meta)
        if msg.role != "explorer":
            return []
        return self.clock.join(msg.name, **self._stored_step(msg.name))

    def _stored_step(self, explorer: str) -> dict[str, Any]:
        """Whether the step `explorer` is running was stored and its tasks completed: it
        restarted or was declared dead between `CompleteTasks` and `ExplorerStepDone`, so only
        the report is missing and the batch counts as done (its tasks are not leased again;
        counting it lost would leave its groups in the buffer and roll new tasks in its place).
        """
        slot = self.clock.explorers.get(explorer)
        if slot is None or not slot.alive or slot.running is None or self.dispatcher is None:
            return {}
        key = (explorer, slot.running[0])
        lease_id = self._step_leases.get(key)
        if lease_id is None or lease_id not in self.dispatcher.done_ids:
            return {}
        del self._step_leases[key]
        return dict(stored=True, groups=self._lease_sizes.pop(key, None))

    def _apply_leased(self, msg: TasksLeased) -> list[Decision]:
        self._need_taskset().apply_lease(msg.lease_id, msg.explorer, msg.step, msg.refs,
                                         msg.deadline, msg.granted_at)
        self._lease_sizes[(msg.explorer, msg.step)] = len(msg.refs)
        self._step_leases[(msg.explorer, msg.step)] = msg.lease_id
        return []

    def _apply_exhausted(self, msg: TasksExhausted) -> list[Decision]:
        return self.clock.tasks_exhausted(msg.explorer)

    def _apply_complete(self, msg: CompleteTasks) -> list[Decision]:
        self._need_taskset().apply_complete(msg.lease_id)
        return []

    def _apply_release(self, msg: ReleaseTasks) -> list[Decision]:
        self._need_taskset().apply_expire(msg.lease_id)
        return []

    def _apply_expired(self, msg: LeaseExpired) -> list[Decision]:
        self._need_taskset().apply_expire(msg.lease_id)
        return []

    def _apply_left(self, msg: ExplorerLeft) -> list[Decision]:
        reg = self.registry.get(msg.explorer)
        if reg is not None:
            reg.alive = False
        decisions = self.clock.leave(msg.explorer, **self._stored_step(msg.explorer))
        if self.dispatcher is not None:
            for lease in self.dispatcher.held_by(msg.explorer):
                self.dispatcher.apply_expire(lease.lease_id)
                # its batch was counted lost: the tasks are rolled out again in a batch that
                # counts (storing nothing new, ids name the task), never completed late here
                self.dispatcher.late.pop(lease.lease_id, None)
        return decisions

    def _apply_explorer_step(self, msg: ExplorerStepDone) -> list[Decision]:
        if self.clock.is_reported(msg.explorer, msg.step, msg.batch):
            return []  # (a journal written before repeats were answered unjournaled)
        groups = self._lease_sizes.get((msg.explorer, msg.step))
        decisions = self.clock.explorer_done(msg.explorer, msg.step, msg.batch, msg.version,
                                             groups, msg.informative)
        self._lease_sizes.pop((msg.explorer, msg.step), None)
        self._step_leases.pop((msg.explorer, msg.step), None)
        return decisions

    def _apply_explorer_draining(self, msg: ExplorerDraining) -> list[Decision]:
        return self.clock.explorer_draining(msg.explorer, msg.step, msg.batch)

    def _apply_trainer_step(self, msg: TrainerStepDone) -> list[Decision]:
        if self.staleness is not None:
            self.staleness = self.staleness_rule.observe(self.staleness, msg.metrics)
        return self.clock.trainer_step_done(msg.step)

    def _apply_staleness(self, msg: StalenessSet) -> list[Decision]:
        if self.staleness is None:
            raise ConfigError([
                f"run_dir: {self.run_dir} holds a run whose staleness bound was set by "
                "sync.max_staleness: auto; resume it with max_staleness: auto, or give this run "
                "a new run_dir"])
        self.staleness = self.staleness.set(msg.bound)
        return self.clock.set_staleness(msg.bound)

    def _judge_staleness(self, step: int, metrics: dict[str, float]) -> list[Decision]:
        """`sync.max_staleness: auto`, after trainer step `step`'s report: journal and trace a
        change of the bound (`StalenessSet`), and return the grants it unlocks."""
        rule = self.staleness_rule
        if rule is None:
            return []
        if rule.metric not in metrics and not self._metric_missing_logged:
            self._metric_missing_logged = True
            log.warning("staleness.metric_missing", metric=rule.metric, step=step,
                        reported=sorted(metrics),
                        why="the bound holds until the trainer reports it; set "
                            "sync.auto.target.metric to one of the reported metrics")
        decision = rule.decide(self.staleness)
        if not decision.changed:
            return []
        msg = StalenessSet(step=step, bound=decision.bound, previous=decision.previous,
                           action=decision.action, metric=rule.metric, value=decision.value,
                           why=decision.why)
        decisions = self._commit(msg)
        log.info("staleness.set", step=step, bound=msg.bound, previous=msg.previous,
                 action=msg.action, metric=msg.metric, value=round(msg.value, 6), why=msg.why)
        self.tracer.event("staleness", step=step, bound=msg.bound, previous=msg.previous,
                          action=msg.action, metric=msg.metric, value=msg.value, why=msg.why)
        return decisions

    def _apply_trainer_resumed(self, msg: TrainerResumed) -> list[Decision]:
        decisions = self.clock.trainer_resumed(msg.step)
        self.trainer_checkpoint = msg.step  # the lineage that goes on holds its checkpoint
        if self._last_weights is not None and self._last_weights.version > self.clock.newest:
            self._last_weights = None  # the lost lineage's version: never republished
        return decisions

    def _apply_trainer_checkpointed(self, msg: TrainerCheckpointed) -> list[Decision]:
        self.trainer_checkpoint = msg.step
        self.clock.checkpointed(msg.step)
        return []

    def _apply_awaiting(self, msg: AwaitingTrainer) -> list[Decision]:
        return self.clock.await_trainer(msg.awaiting)

    def _apply_weights(self, msg: WeightsPublished) -> list[Decision]:
        self._last_weights = msg
        self._weights_events += 1
        return [("weights", msg), *self.clock.published(msg.version, msg.method)]

    def _need_taskset(self) -> TaskDispatcher:
        if self.dispatcher is None:
            raise RequestFailed("no_taskset", "the master has no taskset; set "
                                              "master.taskset.path")
        return self.dispatcher

    # -- publishing ----------------------------------------------------------------------------

    async def _republish(self) -> None:
        """After a restart: continue every topic's sequence and re-send the newest decisions,
        so snapshots are warm; a repeated decision is harmless (components ignore repeats)."""
        if not self.resumed:
            return
        # The publisher numbers topics from 1; a restarted master continues where it stopped
        # so subscribers do not mistake new events for ones they have seen.
        self.publisher.continue_sequences(
            {**self.clock.published_count, "weights": self._weights_events})
        if self._last_weights is not None:
            await self.publisher.publish("weights", self._last_weights)
        for slot in self.clock.alive:
            if slot.running is not None and slot.barrier is not None:
                await self.publisher.publish(barrier_topic(slot.name), slot.barrier)
            if slot.ahead_barrier is not None:  # newest last: the topic's snapshot
                await self.publisher.publish(barrier_topic(slot.name), slot.ahead_barrier)
        if self.clock.last_go is not None and self.clock.trainer_go > self.clock.trainer_done:
            await self.publisher.publish("trainer", self.clock.last_go)
        if self.clock.stop is not None:
            await self.publisher.publish("stop", self.clock.stop)
            self._schedule_done()

    async def _emit(self, decisions: list[Decision]) -> None:
        # structlog renders an event before the level filter sees it: skip debug events unless
        # they will be shown, they sit on the barrier's hot path
        debug = logging.getLogger(__name__).isEnabledFor(logging.DEBUG)
        for topic, msg in decisions:
            await self.publisher.publish(topic, msg)
            if topic == "stop":
                log.info("master.stop", reason=msg.reason)
                self._schedule_done()
            elif topic == "weights":
                log.info("weights.published", version=msg.version, method=msg.method,
                         path=msg.path)
            elif not debug:
                continue
            elif topic == "trainer":
                log.debug("master.trainer_go", step=msg.step, publish=msg.publish)
            else:
                log.debug("master.barrier", explorer=msg.explorer, step=msg.step,
                          version=msg.version, load=msg.wait)

    def _schedule_done(self) -> None:
        if self._ending is None:
            self._note_checkpoint()
            self._ending = asyncio.create_task(self._end_run(), name="master-end")

    def _note_checkpoint(self) -> None:
        """Whether a trainer checkpoint holds every step counted: the run can end."""
        if self.trainer_checkpoint >= self.clock.trainer_done:
            self._checkpointed.set()
        else:
            self._checkpointed.clear()

    async def _end_run(self) -> None:
        """After a Stop: serve until every registered component said Goodbye (it heard the
        Stop and leaves), at most `master.stop_grace` for those that do not, and until the
        trainer's checkpoint holds every step counted (it writes its last one on the Stop).
        A trainer that dies before is restarted from an older checkpoint and re-opens the run
        (`_on_trainer_resumed` cancels this); one that never comes back ends the run as a
        failure, never as done."""
        cfg = self.config.master
        began = time.monotonic()
        deadline = began + cfg.final_checkpoint_wait
        self._note_goodbyes()
        try:
            if not self._all_left.is_set():
                await asyncio.wait_for(self._all_left.wait(), cfg.stop_grace)
            self.ended_by = "goodbyes"
        except TimeoutError:
            self.ended_by = "stop_grace"
            log.warning("master.goodbye_missing", after=cfg.stop_grace, key="master.stop_grace",
                        silent=sorted(name for name, reg in self.registry.items()
                                      if reg.alive and name not in self._goodbyes))
        log.info("master.stop_heard", by=self.ended_by, seconds=round(time.monotonic() - began, 3))
        if not self._checkpointed.is_set():
            self.awaiting_checkpoint = True
            log.info("master.awaiting_checkpoint", steps=self.clock.trainer_done,
                     checkpoint=self.trainer_checkpoint, bound=cfg.final_checkpoint_wait)
        try:
            await asyncio.wait_for(self._checkpointed.wait(),
                                   max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self._failure = TandemError(
                f"master: the run counted {self.clock.trainer_done} trainer steps but the "
                f"trainer's newest checkpoint reported holds {self.trainer_checkpoint} "
                f"(none came within master.final_checkpoint_wait="
                f"{cfg.final_checkpoint_wait:g}s); `tandem up --resume` retrains the lost "
                f"steps from {self.run_dir / 'checkpoints'}")
            log.error("master.checkpoint_missing", steps=self.clock.trainer_done,
                      checkpoint=self.trainer_checkpoint)
        self._done.set()

    # -- handlers: check, then commit ----------------------------------------------------------

    def _touch(self, ctx: CallContext, name: str | None = None) -> None:
        name = name or self._peers.get(ctx.peer)
        if name is None:
            return
        self._peers[ctx.peer] = name
        self.liveness.touch(name)
        reg = self.registry.get(name)
        if reg is not None and not reg.alive and reg.role != "explorer":
            # an explorer's steps were given up when it died: it must register again
            reg.alive = True
            log.info("component.back", name=name, role=reg.role)

    def _check_terms(self, msg: Register) -> None:
        """The master's config is the run's: refuse a component that believes otherwise."""
        mine = self.config.terms(msg.role, msg.name)
        wrong = []
        for key, theirs in sorted(msg.terms.items()):
            if key not in mine:
                wrong.append(f"{key}: the master's config has no such key, {msg.role} "
                             f"{msg.name} has {_show(theirs)}")
            elif mine[key] != theirs:
                wrong.append(f"{key}: master has {_show(mine[key])}, {msg.role} {msg.name} has "
                             f"{_show(theirs)}")
        if wrong:
            log.warning("component.refused", name=msg.name, role=msg.role, mismatches=wrong)
            raise RequestFailed("config_mismatch", "; ".join(wrong) + " (start it with the "
                                                   "master's config, or restart the master)")

    async def _on_register(self, msg: Register, ctx: CallContext) -> Registered:
        self._check_terms(msg)
        async with self._lock:
            decisions = self._commit(msg)
            self._goodbyes.discard(msg.name)  # back (a restart): leaving is its to say again
            self._note_goodbyes()
            self._touch(ctx, msg.name)
            if msg.role == "trainer":
                self._trainer_peer = ctx.peer
            await self._emit(decisions)
            log.info("component.registered", name=msg.name, role=msg.role, pid=msg.pid)
            running, reported = self.clock.holds(msg.name)
            if msg.role == "explorer" and running is None:
                # granted nothing now (its batch waits to be redone, or the trainer): the
                # barrier its last incarnation took must not reach it by snapshot
                self.publisher.withdraw(barrier_topic(msg.name))
        t = self.config.transport
        return Registered(run_id=self.run_id, liveness=t.liveness,
                          heartbeat_interval=t.heartbeat_interval,
                          publish_address=connectable(self.publish_address),
                          trainer_steps=self.clock.trainer_done,
                          granted_step=None if running is None else running[0],
                          granted_batch=None if running is None else running[1],
                          reported_batch=reported)

    def _refuse_dead_explorer(self, name: str) -> None:
        """An explorer declared dead learns it from its next request and registers again."""
        reg = self.registry.get(name)
        if reg is not None and reg.role == "explorer" and not reg.alive:
            raise RequestFailed("declared_dead", (
                f"the master declared {name} dead (silent past transport.liveness) and leased "
                "its tasks out again; register again to get a new step"))

    async def _on_heartbeat(self, msg: Heartbeat, ctx: CallContext) -> HeartbeatAck:
        self._touch(ctx, msg.name)
        self._refuse_dead_explorer(msg.name)
        reg = self.registry.get(msg.name)
        if self.clock.awaiting_trainer and reg is not None and reg.role == "trainer":
            # its heartbeats start once its resume is done: its lineage is the one going on
            async with self._lock:
                if self.clock.awaiting_trainer:
                    log.info("master.trainer_lineage", step=self.clock.trainer_done,
                             newest_version=self.clock.newest)
                    await self._emit(self._commit(AwaitingTrainer(awaiting=False)))
        return HeartbeatAck(name="master")

    async def _on_lease(self, msg: LeaseTasks, ctx: CallContext) -> TaskLease:
        self._touch(ctx, msg.explorer)
        self._refuse_dead_explorer(msg.explorer)
        if self.clock.is_reported(msg.explorer, msg.step, msg.batch):
            raise RequestFailed("step_reported", (
                f"{msg.explorer} already reported step {msg.step} batch {msg.batch}: its barrier "
                "is stale (a step is reported once); wait for the next one"))
        d = self._need_taskset()
        lease = d.open_lease(msg.explorer, msg.step)
        if lease is None:
            refs = d.plan_lease(msg.count)
            if not refs:
                async with self._lock:
                    slot = self.clock.explorers.get(msg.explorer)
                    if slot is None or not slot.finished:
                        log.info("tasks.exhausted", explorer=msg.explorer, step=msg.step,
                                 **d.counters())
                        await self._emit(self._commit(TasksExhausted(explorer=msg.explorer)))
                return TaskLease(lease_id="", tasks=[], deadline=time.time(), exhausted=True)
            now = time.time()
            leased = TasksLeased(lease_id=d.new_lease_id(), explorer=msg.explorer, step=msg.step,
                                 refs=refs, granted_at=now,
                                 deadline=now + self.config.master.task_lease_seconds)
            self._commit(leased)
            lease = d.leases[leased.lease_id]
        return TaskLease(lease_id=lease.lease_id, tasks=[d.task(r) for r in lease.refs],
                         deadline=lease.deadline, exhausted=d.exhausted)

    async def _on_release(self, msg: ReleaseTasks, ctx: CallContext) -> Ok:
        self._touch(ctx)
        d = self._need_taskset()
        async with self._lock:
            lease = d.leases.get(msg.lease_id)
            if lease is not None:  # else: done or expired already
                self._commit(msg)
                log.warning("lease.expired", lease_id=lease.lease_id, explorer=lease.explorer,
                            tasks=len(lease.refs),
                            why=f"released: {msg.reason or 'no reason given'}")
        return Ok()

    async def _on_complete(self, msg: CompleteTasks, ctx: CallContext) -> Ok:
        self._touch(ctx)
        self._complete(msg.lease_id)
        return Ok()

    def _complete(self, lease_id: str) -> None:
        """Journal the lease's tasks as done (once: a repeat is a no-op); `unknown_lease` when
        it is not open: never granted, or given up with its explorer."""
        d = self._need_taskset()
        if lease_id in d.done_ids:
            return
        if lease_id not in d.leases and lease_id not in d.late:
            raise RequestFailed("unknown_lease", f"lease {lease_id!r} is not open: never "
                                "granted, or its explorer was declared dead and its tasks were "
                                "leased out again")
        self._commit(CompleteTasks(lease_id=lease_id))

    async def _on_explorer_step(self, msg: ExplorerStepDone, ctx: CallContext) -> Ok:
        self._touch(ctx, msg.explorer)
        if msg.lease_id is not None:
            # what a CompleteTasks just before it did, answered the same way: the experiences
            # are stored whatever becomes of the report, and a lost lease is the explorer's
            # warning, not a refusal of its report
            try:
                self._complete(msg.lease_id)
            except RequestFailed as exc:
                log.warning("explorer.lease_lost", explorer=msg.explorer, lease=msg.lease_id,
                            step=msg.step, error=exc.message,
                            hint="raise master.task_lease_seconds")
            msg = msg.model_copy(update={"lease_id": None})  # journaled as CompleteTasks
        async with self._lock:
            if self.clock.is_reported(msg.explorer, msg.step, msg.batch):
                log.warning("explorer.step_repeated", explorer=msg.explorer, step=msg.step,
                            batch=msg.batch, why="counted once already; answered, not counted")
                return Ok()
            try:
                decisions = self._commit(msg)
            except DeclaredDead as exc:
                raise RequestFailed("declared_dead", str(exc)) from None
            except StepMismatch as exc:
                raise RequestFailed("unexpected_step", str(exc)) from None
            await self._emit(decisions)
        return Ok()

    async def _on_explorer_draining(self, msg: ExplorerDraining, ctx: CallContext) -> Ok:
        self._touch(ctx, msg.explorer)
        self._refuse_dead_explorer(msg.explorer)
        async with self._lock:
            slot = self.clock.explorers.get(msg.explorer)
            if (self.plan.asynchronous and slot is not None and slot.running is not None
                    and slot.running[:2] == (msg.step, msg.batch) and not slot.draining):
                await self._emit(self._commit(msg))  # else: stale or repeated, nothing to do
        return Ok()

    def _check_trainer(self, ctx: CallContext, what: str) -> None:
        """Only the client that registered as the trainer reports for it. After a master
        restart the trainer is known from the journal by name but not by its connection: its
        first report binds it again."""
        if ctx.peer == self._trainer_peer:
            return
        if self._trainer_peer is None and any(
                reg.role == "trainer" for reg in self.registry.values()):
            self._trainer_peer = ctx.peer
            log.info("trainer.rebound", peer=ctx.peer, why="first report since a master restart")
            return
        registered = self._peers.get(ctx.peer)
        who = (f"{registered} (connection {ctx.peer})" if registered is not None
               else f"an unregistered client (connection {ctx.peer})")
        log.debug("trainer.report_refused", peer=who, what=what)
        raise RequestFailed("not_the_trainer", (
            f"{what} from {who}, which did not register as the trainer; only the component "
            "that sent Register with role trainer reports trainer steps"))

    async def _on_trainer_step(self, msg: TrainerStepDone, ctx: CallContext) -> Ok:
        self._check_trainer(ctx, f"TrainerStepDone(step={msg.step})")
        self._touch(ctx)
        async with self._lock:
            try:
                self.clock.check_trainer_step(msg.step)
            except StepMismatch as exc:
                raise RequestFailed("unexpected_step", str(exc)) from None
            published = msg.published
            decisions = self._commit(msg.model_copy(update={"published": None}))
            decisions += self._judge_staleness(msg.step, msg.metrics)
            if published is not None:  # what a WeightsPublished just after it did
                decisions += self._commit(published)
            await self._emit(decisions)
        return Ok()

    async def _on_trainer_resumed(self, msg: TrainerResumed, ctx: CallContext) -> Ok:
        self._check_trainer(ctx, f"TrainerResumed(step={msg.step})")
        self._touch(ctx)
        async with self._lock:
            before = self.clock.trainer_done
            try:
                decisions = self._commit(msg)
            except StepMismatch as exc:
                raise RequestFailed("resume_ahead", f"{exc}: its checkpoint {msg.checkpoint} "
                                    "is newer than the master's journal (was the journal "
                                    "lost?)") from None
            if not self.clock.stopped and self._ending is not None:
                self._ending.cancel()  # the run goes on: the steps after it are retrained
                self._ending = None
                self.publisher.withdraw("stop")  # a late joiner's snapshot must not end it
            self._note_checkpoint()
            log.info("trainer.resumed", step=msg.step, master_had=before,
                     retrain=f"{msg.step}..{before - 1}" if before > msg.step else "nothing",
                     checkpoint=msg.checkpoint, lineage=msg.lineage)
            await self._emit(decisions)
        return Ok()

    async def _on_trainer_checkpointed(self, msg: TrainerCheckpointed, ctx: CallContext) -> Ok:
        self._check_trainer(ctx, f"TrainerCheckpointed(step={msg.step})")
        self._touch(ctx)
        async with self._lock:
            if msg.step > self.clock.trainer_done:
                raise RequestFailed("checkpoint_ahead", (
                    f"the trainer reported a checkpoint of {msg.step} steps but the master "
                    f"counted {self.clock.trainer_done}; a checkpoint holds counted steps only"))
            self._commit(msg)
            self._note_checkpoint()
            log.info("trainer.checkpointed", step=msg.step, counted=self.clock.trainer_done,
                     checkpoint=msg.checkpoint)
        return Ok()

    async def _on_weights(self, msg: WeightsPublished, ctx: CallContext) -> Ok:
        self._touch(ctx)
        async with self._lock:
            await self._emit(self._commit(msg))
        return Ok()

    async def _on_goodbye(self, msg: Goodbye, ctx: CallContext) -> Ok:
        # not journaled: it changes no state of the run, only how long this master serves
        self._goodbyes.add(msg.name)
        log.info("component.goodbye", name=msg.name, stopped=self.clock.stopped)
        self._note_goodbyes()
        return Ok()

    def _note_goodbyes(self) -> None:
        """Whether every component alive in the registry said Goodbye: nobody is left to
        hear the Stop, so its grace may end."""
        if all(name in self._goodbyes for name, reg in self.registry.items() if reg.alive):
            self._all_left.set()
        else:
            self._all_left.clear()

    async def _on_status(self, msg: GetStatus, ctx: CallContext) -> Status:
        return self.status()

    def status(self) -> Status:
        now = time.monotonic()
        components = []
        for name, reg in sorted(self.registry.items()):
            seen = self.liveness.last_seen.get(name)
            components.append(ComponentStatus(
                name=name, role=reg.role, alive=reg.alive, pid=reg.pid, host=reg.host,
                address=reg.address, silent_for=None if seen is None else round(now - seen, 3)))
        tasks = {} if self.dispatcher is None else self.dispatcher.counters()
        # the clock's plan: with max_staleness: auto, its bound is the current one
        counters = RunCounters(plan=PlanKnobs(**self.clock.plan.describe()),
                               **self.clock.counters(),
                               **tasks)
        leases = [] if self.dispatcher is None else [
            LeaseStatus(**lease.describe()) for lease in self.dispatcher.leases.values()]
        explorers = [slot.describe(self.clock.newest, self.clock.trainer_done)
                     for slot in self.clock.explorers.values()]
        return Status(run_id=self.run_id, components=components, counters=counters,
                      leases=leases, explorers=explorers)

    # -- background: liveness and lease deadlines ----------------------------------------------

    async def _watch(self) -> None:
        interval = min(self.config.transport.heartbeat_interval,
                       self.config.transport.liveness / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._check()
            except Exception:
                log.exception("master.watch_failed")

    async def _check(self) -> None:
        async with self._lock:
            for name in self.liveness.silent():
                self.liveness.forget(name)
                reg = self.registry.get(name)
                if reg is None or not reg.alive:
                    continue
                log.warning("component.dead", name=name, role=reg.role,
                            silent_for=self.liveness.liveness)
                self._m_dead.labels(reg.role).inc()
                if reg.role != "explorer":
                    reg.alive = False  # it is back as soon as it speaks (`_touch`)
                    continue
                held = [] if self.dispatcher is None else self.dispatcher.held_by(name)
                await self._emit(self._commit(ExplorerLeft(explorer=name)))
                for lease in held:
                    self._m_leases_expired.labels("explorer dead").inc()
                    log.warning("lease.expired", lease_id=lease.lease_id, explorer=name,
                                tasks=len(lease.refs), why="explorer dead")
            if self.dispatcher is not None:
                for lease in self.dispatcher.due(time.time()):
                    self._commit(LeaseExpired(lease_id=lease.lease_id))
                    self._m_leases_expired.labels("deadline").inc()
                    log.warning("lease.expired", lease_id=lease.lease_id,
                                explorer=lease.explorer, tasks=len(lease.refs), why="deadline")
        # fsync off the event loop: it can take milliseconds, and barriers must not wait for it
        await asyncio.to_thread(self.journal.maybe_sync)


__all__ = ["Master", "total_steps_for"]
