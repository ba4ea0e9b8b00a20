"""The master service: registry and liveness, task leases, step reports, barrier decisions.

`Master(config)` serves the master protocol (`tandem.common.messages.master`) on
`master.address` and publishes decisions on `master.publish_address`. All run state lives in
a `RunClock` (barriers) and a `TaskDispatcher` (leases); every input that changes them is
written to the journal first, so a restarted master replays the journal and carries on, and
components that kept running simply reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import structlog

from tandem.common.config import RunConfig
from tandem.common.errors import ConfigError, RequestFailed
from tandem.common.heartbeat import Liveness
from tandem.common.messages.base import Heartbeat, HeartbeatAck, Ok
from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerStepDone,
    GetStatus,
    LeaseTasks,
    Register,
    Registered,
    ReleaseTasks,
    Status,
    TaskLease,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from tandem.common.pubsub import Publisher
from tandem.common.rpc import CallContext, RpcServer
from tandem.common.sync import SyncPlan

from .clock import Decision, RunClock, StepMismatch
from .journal import Journal
from .taskset import TaskDispatcher, load_rows

log = structlog.get_logger(__name__)


def total_steps_for(config: RunConfig, dispatcher: TaskDispatcher | None) -> int:
    """`master.total_steps`, or as many steps as the taskset fills."""
    if config.master.total_steps is not None:
        return config.master.total_steps
    if dispatcher is None:
        raise ConfigError(["master: the run needs a length; set master.total_steps or "
                           "master.taskset.path"])
    per_step = sum(e.batch_size for e in config.explorers)
    steps = dispatcher.total // per_step
    if steps < 1:
        raise ConfigError([f"master.taskset: {dispatcher.total} tasks (x epochs) fill no step of "
                           f"{per_step} tasks (sum of explorers[*].batch_size)"])
    return steps


class Master:
    """The run's clock as a component: `await Master(config).serve()`."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.run_dir = Path(config.run_dir)
        cfg = config.master
        self.plan = SyncPlan.from_config(config.sync, batches_per_step=len(config.explorers))
        self.dispatcher = (TaskDispatcher(load_rows(cfg.taskset), cfg.taskset)
                           if cfg.taskset.path else None)
        self.total_steps = total_steps_for(config, self.dispatcher)
        self.clock = RunClock(self.plan, self.total_steps)
        self.registry: dict[str, dict[str, Any]] = {}
        self.liveness = Liveness(config.transport.liveness)
        self.journal = Journal(self.run_dir / cfg.journal)
        self.run_id = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.server = RpcServer(cfg.address, name="master", transport=config.transport)
        self.publisher = Publisher(cfg.publish_address, name="master",
                                   transport=config.transport)
        self.address: str | None = None
        self.publish_address: str | None = None
        self.resumed = False
        self._last_weights: WeightsPublished | None = None
        self._weights_events = 0
        self._peers: dict[str, str] = {}  # RPC identity -> component name
        self._lease_sizes: dict[tuple[str, int], int] = {}  # (explorer, step) -> tasks leased
        self._loop_task: asyncio.Task | None = None
        self._done: asyncio.Event | None = None
        self._closed = False
        self._lock = asyncio.Lock()
        for msg_type, handler in ((Register, self._on_register), (Heartbeat, self._on_heartbeat),
                                  (LeaseTasks, self._on_lease), (CompleteTasks, self._on_complete),
                                  (ReleaseTasks, self._on_release),
                                  (ExplorerStepDone, self._on_explorer_step),
                                  (TrainerStepDone, self._on_trainer_step),
                                  (WeightsPublished, self._on_weights),
                                  (GetStatus, self._on_status)):
            self.server.register(msg_type, handler)
        self.publisher.serve_snapshots(self.server)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> str:
        """Replay the journal, bind both sockets, republish the current state; returns the RPC
        address as bound."""
        if self.address is not None:
            return self.address
        self._done = asyncio.Event()
        self._replay()
        self.journal.open()
        if not self.resumed:
            self.journal.append("start", run_id=self.run_id, total_steps=self.total_steps,
                                plan=self.plan.describe())
        self.publish_address = await self.publisher.start()
        self.address = await self.server.start()
        await self._republish()
        self._loop_task = asyncio.create_task(self._watch(), name="master-watch")
        log.info("master.started", address=self.address, publish=self.publish_address,
                 run_id=self.run_id, resumed=self.resumed, total_steps=self.total_steps,
                 plan=self.plan.describe())
        return self.address

    async def serve(self) -> None:
        """Serve until the run is done (plus `master.stop_grace`) or `close()`."""
        await self.start()
        await self._done.wait()
        await self.close()

    def request_stop(self) -> None:
        """Make `serve()` return (from a signal handler or another task)."""
        if self._done is not None:
            self._done.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done is not None:
            self._done.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self.server.close()
        await self.publisher.close()
        self.journal.close()
        log.info("master.closed", run_id=self.run_id, **self.clock.counters())

    # -- journal -------------------------------------------------------------------------------

    def _replay(self) -> None:
        records = 0
        for rec in self.journal.replay():
            records += 1
            kind = rec["k"]
            try:
                if kind == "start":
                    self.run_id = rec["run_id"]
                    self._check_same_run(rec)
                elif kind == "register":
                    self.registry[rec["name"]] = rec["info"]
                elif kind == "join":
                    self.clock.join(rec["name"])
                elif kind == "exhausted":
                    self.clock.tasks_exhausted(rec["name"])
                elif kind == "leave":
                    self.clock.leave(rec["name"])
                    if rec["name"] in self.registry:
                        self.registry[rec["name"]]["alive"] = False
                elif kind == "explorer_done":
                    self.clock.explorer_done(rec["name"], rec["step"], rec["batch"],
                                             rec["version"], rec.get("groups"))
                elif kind == "trainer_done":
                    self.clock.trainer_step_done(rec["step"])
                elif kind == "published":
                    self.clock.published(rec["version"])
                    self._last_weights = WeightsPublished(**rec["msg"])
                    self._weights_events += 1
                elif kind == "lease" and self.dispatcher is not None:
                    self.dispatcher.apply_lease(rec["id"], rec["explorer"], rec["step"],
                                                rec["refs"], rec["deadline"], rec["granted_at"])
                    self._lease_sizes[(rec["explorer"], rec["step"])] = len(rec["refs"])
                elif kind == "complete" and self.dispatcher is not None:
                    self.dispatcher.apply_complete(rec["id"])
                elif kind == "expire" and self.dispatcher is not None:
                    self.dispatcher.apply_expire(rec["id"])
            except (KeyError, TypeError, StepMismatch) as exc:
                log.warning("journal.skipped", record=rec, error=str(exc))
        if records:
            self.resumed = True
            now = time.monotonic()
            for name, info in self.registry.items():
                if info.get("alive", True):
                    self.liveness.touch(name, now)  # give everyone a full liveness to reconnect
            log.info("master.resumed", records=records, **self.clock.counters())

    def _check_same_run(self, start: dict[str, Any]) -> None:
        if start.get("plan") != self.plan.describe():
            raise ConfigError([
                f"run_dir: {self.run_dir} holds the journal of run {start['run_id']} with sync "
                f"plan {start.get('plan')}, not {self.plan.describe()}; resume it with the same "
                "sync section and explorers, or give this run a new run_dir"])
        if start.get("total_steps") != self.total_steps:
            log.warning("master.total_steps_changed", journal=start.get("total_steps"),
                        now=self.total_steps)

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
            elif not debug:
                continue
            elif topic == "trainer":
                log.debug("master.trainer_go", step=msg.step, publish=msg.publish)
            else:
                log.debug("master.barrier", explorer=msg.explorer, step=msg.step,
                          version=msg.version, load=msg.wait)

    def _schedule_done(self) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.master.stop_grace, self._done.set)

    # -- handlers ------------------------------------------------------------------------------

    def _touch(self, ctx: CallContext, name: str | None = None) -> None:
        name = name or self._peers.get(ctx.peer)
        if name is None:
            return
        self._peers[ctx.peer] = name
        self.liveness.touch(name)
        info = self.registry.get(name)
        if info is not None and not info.get("alive", True) and info["role"] != "explorer":
            # an explorer's steps were given up when it died: it must register again
            info["alive"] = True
            log.info("component.back", name=name, role=info["role"])

    async def _on_register(self, msg: Register, ctx: CallContext) -> Registered:
        async with self._lock:
            info = dict(name=msg.name, role=msg.role, address=msg.address, pid=msg.pid,
                        host=msg.host, meta=msg.meta, registered_at=time.time(), alive=True)
            self.registry[msg.name] = info
            self._touch(ctx, msg.name)
            self.journal.append("register", name=msg.name, info=info)
            if msg.role == "explorer":
                self.journal.append("join", name=msg.name)
                await self._emit(self.clock.join(msg.name))
            log.info("component.registered", name=msg.name, role=msg.role, pid=msg.pid)
        return Registered(run_id=self.run_id, sync=self.config.sync.model_dump(),
                          liveness=self.config.transport.liveness,
                          publish_address=self.publish_address or "")

    async def _on_heartbeat(self, msg: Heartbeat, ctx: CallContext) -> HeartbeatAck:
        self._touch(ctx, msg.name)
        return HeartbeatAck(name="master")

    async def _on_lease(self, msg: LeaseTasks, ctx: CallContext) -> TaskLease:
        self._touch(ctx, msg.explorer)
        if self.dispatcher is None:
            raise RequestFailed("no_taskset", "the master has no taskset; set "
                                              "master.taskset.path")
        d = self.dispatcher
        lease = d.open_lease(msg.explorer, msg.step)
        if lease is None:
            refs = d.plan_lease(msg.count)
            if not refs:
                async with self._lock:
                    slot = self.clock.explorers.get(msg.explorer)
                    if slot is None or not slot.finished:
                        log.info("tasks.exhausted", explorer=msg.explorer, step=msg.step,
                                 **d.counters())
                        self.journal.append("exhausted", name=msg.explorer)
                        await self._emit(self.clock.tasks_exhausted(msg.explorer))
                return TaskLease(lease_id="", tasks=[], deadline=time.time(), exhausted=True)
            now = time.time()
            lease_id = d.new_lease_id()
            deadline = now + self.config.master.task_lease_seconds
            self.journal.append("lease", id=lease_id, explorer=msg.explorer, step=msg.step,
                                refs=refs, deadline=deadline, granted_at=now)
            lease = d.apply_lease(lease_id, msg.explorer, msg.step, refs, deadline, now)
            self._lease_sizes[(msg.explorer, msg.step)] = len(refs)
        return TaskLease(lease_id=lease.lease_id, tasks=[d.task(r) for r in lease.refs],
                         deadline=lease.deadline, exhausted=d.exhausted)

    async def _on_release(self, msg: ReleaseTasks, ctx: CallContext) -> Ok:
        self._touch(ctx)
        if self.dispatcher is None:
            raise RequestFailed("no_taskset", "the master has no taskset")
        async with self._lock:
            if msg.lease_id in self.dispatcher.leases:  # else: done or expired already
                self._expire(msg.lease_id, why=f"released: {msg.reason or 'no reason given'}")
        return Ok()

    async def _on_complete(self, msg: CompleteTasks, ctx: CallContext) -> Ok:
        self._touch(ctx)
        if self.dispatcher is None:
            raise RequestFailed("no_taskset", "the master has no taskset")
        d = self.dispatcher
        if msg.lease_id in d.done_ids:
            return Ok()
        if msg.lease_id not in d.leases and msg.lease_id not in d.late:
            raise RequestFailed("unknown_lease", f"the master never granted lease "
                                                 f"{msg.lease_id!r}")
        self.journal.append("complete", id=msg.lease_id)
        d.apply_complete(msg.lease_id)
        return Ok()

    async def _on_explorer_step(self, msg: ExplorerStepDone, ctx: CallContext) -> Ok:
        self._touch(ctx, msg.explorer)
        async with self._lock:
            try:
                groups = self._lease_sizes.get((msg.explorer, msg.step))
                decisions = self.clock.explorer_done(msg.explorer, msg.step, msg.batch,
                                                     msg.version, groups)
            except StepMismatch as exc:
                raise RequestFailed("unexpected_step", str(exc)) from None
            self._lease_sizes.pop((msg.explorer, msg.step), None)
            self.journal.append("explorer_done", name=msg.explorer, step=msg.step,
                                batch=msg.batch, version=msg.version, groups=groups,
                                experiences=msg.experiences)
            await self._emit(decisions)
        return Ok()

    async def _on_trainer_step(self, msg: TrainerStepDone, ctx: CallContext) -> Ok:
        self._touch(ctx)
        async with self._lock:
            self.journal.append("trainer_done", step=msg.step, version=msg.version)
            await self._emit(self.clock.trainer_step_done(msg.step))
        return Ok()

    async def _on_weights(self, msg: WeightsPublished, ctx: CallContext) -> Ok:
        self._touch(ctx)
        async with self._lock:
            self.journal.append("published", version=msg.version, msg=msg.model_dump())
            self._last_weights = msg
            self._weights_events += 1
            await self.publisher.publish("weights", msg)
            log.info("weights.published", version=msg.version, method=msg.method, path=msg.path)
            await self._emit(self.clock.published(msg.version))
        return Ok()

    async def _on_status(self, msg: GetStatus, ctx: CallContext) -> Status:
        return self.status()

    def status(self) -> Status:
        now = time.monotonic()
        components = []
        for name, info in sorted(self.registry.items()):
            seen = self.liveness.last_seen.get(name)
            components.append(dict(
                name=name, role=info["role"], alive=info.get("alive", True), pid=info.get("pid"),
                host=info.get("host"), address=info.get("address"),
                silent_for=None if seen is None else round(now - seen, 3)))
        counters = dict(self.clock.counters(), plan=self.plan.describe())
        if self.dispatcher is not None:
            counters.update(self.dispatcher.counters())
        leases = [] if self.dispatcher is None else [
            lease.describe() for lease in self.dispatcher.leases.values()]
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
                info = self.registry.get(name)
                if info is None or not info.get("alive", True):
                    continue
                info["alive"] = False
                log.warning("component.dead", name=name, role=info["role"],
                            silent_for=self.liveness.liveness)
                if info["role"] == "explorer":
                    self.journal.append("leave", name=name)
                    await self._emit(self.clock.leave(name))
                    if self.dispatcher is not None:
                        for lease in self.dispatcher.held_by(name):
                            self._expire(lease.lease_id, why="explorer dead")
            if self.dispatcher is not None:
                for lease in self.dispatcher.due(time.time()):
                    self._expire(lease.lease_id, why="deadline")
        # fsync off the event loop: it can take milliseconds, and barriers must not wait for it
        await asyncio.to_thread(self.journal.maybe_sync)

    def _expire(self, lease_id: str, why: str) -> None:
        lease = self.dispatcher.leases[lease_id]
        self.journal.append("expire", id=lease_id)
        self.dispatcher.apply_expire(lease_id)
        log.warning("lease.expired", lease_id=lease_id, explorer=lease.explorer,
                    tasks=len(lease.refs), why=why)


def run_master(config: RunConfig) -> int:
    """The `tandem-master` process: serve until done or SIGTERM/SIGINT; returns an exit code."""
    from tandem.common.logging import configure_logging
    from tandem.common.sockets import install_uvloop

    configure_logging("master", level=config.logging.level, run_dir=config.run_dir,
                      json_console=config.logging.json_console)
    install_uvloop()

    async def main() -> None:
        master = Master(config)

        def on_signal(sig: signal.Signals) -> None:
            # a signal only sets a flag; serve() then closes the sockets and the journal
            log.info("master.signal", signal=sig.name)
            master.request_stop()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await master.serve()

    asyncio.run(main())
    return 0


__all__ = ["Master", "run_master", "total_steps_for"]
