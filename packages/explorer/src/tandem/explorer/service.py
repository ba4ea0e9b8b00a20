"""The explorer service: barriers in, experiences out.

One step, as the master protocol has it (`tandem.common.messages.master`):

    wait for Barrier(step, version) -> load `version` if told -> LeaseTasks -> roll out
    -> PutExperiences (acked once durable) -> ExplorerStepDone (which completes the task lease,
    journaled as CompleteTasks) -> next Barrier

The master alone decides when a step may start and with which weights (`SyncPlan`); the
explorer waits only for its barrier, up to `sync.timeout`. Generation runs on the engine's
thread, so heartbeats and the subscription keep going while a batch is being sampled.

Streaming (`explorers[].streaming`, on in the asynchronous presets): within a step, each task's
group is put as soon as it is scored, while the engine samples the others; ExplorerStepDone
still follows the step's last put. Across steps (`explorers[].lease_ahead`,
asynchronous plans): once a step's first group is scored, the explorer sends ExplorerDraining,
and the master's barrier for the next step may come while this one drains; the next step then
leases its tasks and hands them to the engine at once (after this step's generation when it
must load weights first), so the engine never waits for a report and a barrier. At most two
steps are in flight; their reports go in grant order. Interruptible (`on_new_weights: interrupt`):
while a step generates, the explorer listens for published versions and loads each newer one
at once; the engine takes it at its next token boundary and every token records its version.
Colocated (`placement.colocate`): a barrier with `sleep_after` has the engine sleep once the
step's experiences are stored and before the step is reported, so the trainer, released by
that report, never trains beside a resident engine; the next load wakes it (a `sleep` span, then
`wake` and `sync`).

An explorer the master declared dead (silent past `transport.liveness`, e.g. paused) learns it
from a refused heartbeat or report (`declared_dead`), registers again and carries on: the
tasks of the batch it was rolling out were leased out again, and since experience ids name
the task's place in the run, whatever it already put is stored once.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from typing import Any

import numpy as np
import structlog

from tandem.common import failpoints
from tandem.common.config import RunConfig
from tandem.common.errors import PeerDead, RequestFailed, TandemError, WaitTimeout
from tandem.common.groups import informative_groups
from tandem.common.heartbeat import Heartbeater, say_goodbye
from tandem.common.images import image_hash
from tandem.common.messages.buffer import PutExperiences
from tandem.common.messages.experience import Experience, Task
from tandem.common.messages.master import (
    Barrier,
    ExplorerDraining,
    ExplorerStepDone,
    LeaseTasks,
    Register,
    Registered,
    ReleaseTasks,
    Stop,
    TaskLease,
    TrainerGo,
    WeightsPublished,
    barrier_topic,
)
from tandem.common.metrics import MetricsEndpoint
from tandem.common.pubsub import Event, Subscriber
from tandem.common.rpc import RpcClient
from tandem.common.trace import Tracer

from .engine import Engine
from .engines import create_engine
from .eval_role import WeightFollower
from .evaluation import Evaluator
from .rewards import InProcessScorer, RewardScorer, create_scorer
from .sampling import SamplingParams
from .weights import WeightLoader
from .workflows import (
    RolloutContext, Workflow, create_workflow, settle_group_versions, workflow_needs)

log = structlog.get_logger(__name__)


class Explorer:
    """One explorer as a component: `await Explorer(config, name).serve()`, then `close()`.

    `engine` and `scorer` may be handed in (an embedding program that already holds a model);
    otherwise they are built from the config when the explorer starts.
    """

    def __init__(self, config: RunConfig, name: str, *, engine: Engine | None = None,
                 scorer: RewardScorer | None = None):
        self.config = config
        self.cfg = config.explorer(name)
        self.name = name
        # role eval: registers as an evaluator, which the master's clock never counts
        self.role = "evaluator" if self.cfg.role == "eval" else "explorer"
        self.engine = engine
        self.scorer = scorer
        self.sampling = SamplingParams.from_config(self.cfg.sampling)
        self.streaming = (self.cfg.streaming if self.cfg.streaming is not None
                          else config.sync.asynchronous)
        self.interrupt = self.cfg.on_new_weights == "interrupt"
        # the next step's barrier is asked for while this one drains (not with interrupt: its
        # weight watcher reads the subscription while a step generates)
        self.lease_ahead = (self.streaming and config.sync.asynchronous and self.cfg.lease_ahead
                            and not self.interrupt and self.cfg.role != "eval")
        self._held: deque[Event] = deque()  # read while a step generated, for the next wait
        self._inflight_load: asyncio.Future | None = None  # interrupt: a load begun mid-step
        self.workflow: Workflow | None = None
        self.endpoint: Any = None  # the OpenAI endpoint (openai_server), when it serves one
        self.loader: WeightLoader | None = None
        self.evaluator: Evaluator | None = None  # this explorer evaluates (`eval.explorer`)
        self.tracer = Tracer(config.run_dir if config.logging.trace else None, name)
        self.master = RpcClient(config.master.address, peer="master",
                                transport=config.transport, name=name)
        self.buffer = RpcClient(config.buffer.address, peer="buffer",
                                transport=config.transport, name=name)
        self.subscriber: Subscriber | None = None
        self.heartbeater: Heartbeater | None = None
        self.run_id = ""
        self.steps_done = 0
        self.stop_reason: str | None = None
        self._stopping = False
        self._taken_batches: set[int] = set()  # barriers started: a repeat is ignored
        self._reported_through = -1  # the master counted batches up to it from this explorer
        self._latest_weights: WeightsPublished | None = None
        self._flight: _Flight | None = None  # the newest step started
        self._leases: dict[int, str] = {}  # batch -> lease id: leased, not yet completed
        self._declared_dead = asyncio.Event()  # the master refused us as dead: register again
        # when the latest Register was answered (monotonic): a refusal of a request sent before
        # it speaks of the registration that ended, not of this one (`_refused_as_dead`)
        self._registered_at = float("-inf")
        self.rejoins = 0
        self._wait_task: asyncio.Task | None = None
        self._owns_engine = engine is None
        self._owns_scorer = scorer is None
        self._warm_up: asyncio.Task | None = None  # the in-process scorer's start
        self._closed = False
        self._asleep = False  # placement.colocate: the engine released its weights
        index = [e.name for e in config.explorers].index(name)
        self.metrics = MetricsEndpoint(config.logging.metrics, "explorer", name, index=index,
                                       run_dir=config.run_dir)
        self.metrics.observe_spans(self.tracer)
        self.metrics.gauge_fn("steps", "explorer steps rolled out", lambda: self.steps_done)
        self.metrics.gauge_fn("version", "weights version the engine holds",
                              lambda: self.engine.version if self.engine is not None else -1)
        self.metrics.gauge_fn(
            "reward", "in-process reward scoring by function: evaluated, timeouts, errors, "
            "seconds (running totals)",
            lambda: {(fn, stat): v for fn, stats in getattr(self.scorer, "stats", {}).items()
                     for stat, v in stats.items()}, labels=("function", "stat"))
        self.metrics.gauge_fn(
            "token_mismatches", "agent experiences that are not token for token what the engine "
            "was given and produced (running total; anything but 0 is a bug)",
            lambda: self.endpoint.calls.mismatches if self.endpoint is not None else 0)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the engine, register with the master, subscribe to its decisions."""
        self.metrics.start()
        needs = workflow_needs(self.cfg.workflow)
        if self.scorer is None and needs.scorer:
            self.scorer = create_scorer(self.config.reward, self.config.transport, name=self.name)
            if isinstance(self.scorer, InProcessScorer):
                # its worker processes import (1-5 s on a loaded machine) while the engine
                # loads and this explorer registers, not inside the first step's first score
                self._warm_up = asyncio.ensure_future(self._warm_up_scorer())
        if self.engine is None:
            try:
                self.engine = await asyncio.to_thread(
                    create_engine, self.cfg.engine, self.config.model,
                    lora_adapters=self.config.weights.lora_transfer == "adapter")
            except (OSError, ValueError) as exc:  # no model folder, bad engine options
                raise TandemError(f"explorer {self.name} cannot load its engine: {exc}") from None
        if self.interrupt:
            # the config admits interrupt only for an engine whose capabilities declare it
            self.engine.interruptible = True
        self.workflow = create_workflow(self.cfg.workflow, self.engine.tokenizer,
                                        self.cfg.workflow_args)
        if self.cfg.openai.enabled or needs.endpoint:
            from .openai_server import OpenAIEndpoint, model_context

            self.endpoint = OpenAIEndpoint(
                self.cfg.openai, self.engine, sampling=self.sampling,
                context=model_context(self.config.model.path), name=self.name,
                url_dir=os.path.join(self.config.run_dir, "openai"))
        self.workflow.attach(self.endpoint, repeat_times=self.cfg.repeat_times,
                             tracer=self.tracer, metrics=self.metrics)
        if self.endpoint is not None:
            await self.endpoint.start()
        if self.config.eval.enabled and self.config.evaluating_explorer == self.name:
            self.evaluator = Evaluator(self.config, self.name)
        fetcher = None
        if self.config.weights.transport == "fetch":
            from tandem.weights.fetch import WeightFetcher

            fetcher = WeightFetcher.from_config(self.config, self.name)
        self.loader = WeightLoader(self.engine, run_dir=self.config.run_dir, explorer=self.name,
                                   timeout=self.config.sync.timeout,
                                   device=self.cfg.engine.device, fetcher=fetcher,
                                   shared_memory=self.config.weights.transport == "shared_memory")
        log.info("explorer.connecting", explorer=self.name, master=self.config.master.address,
                 buffer=self.config.buffer.address)
        reply = await self._register()
        publish = reply.publish_address or self.config.master.publish_address
        self.subscriber = Subscriber(
            # barrier_topic ends in a dot: explorer-1 does not also hear explorer-10's barriers
            publish, topics=[barrier_topic(self.name), "weights", "trainer", "stop"],
            transport=self.config.transport, snapshot=self.master)
        await self.subscriber.start()
        # the master's liveness, so both sides agree on when silence means death
        self.heartbeater = Heartbeater(self.master, name=self.name, role=self.role,
                                       interval=reply.heartbeat_interval, liveness=reply.liveness,
                                       on_refused=self._on_refused)
        self.heartbeater.start()
        log.info("explorer.started", explorer=self.name, run_id=self.run_id,
                 workflow=self.cfg.workflow, batch_size=self.cfg.batch_size,
                 repeat_times=self.cfg.repeat_times, version=self.engine.version)

    async def _warm_up_scorer(self) -> None:
        try:
            await self.scorer.start()
        except Exception as exc:  # the first score raises it again, and reports it
            log.warning("reward.warm_up_failed", explorer=self.name, error=str(exc))

    async def _register(self) -> Registered:
        reply = await self.master.call(
            Register(name=self.name, role=self.role, pid=os.getpid(), host=socket.gethostname(),
                     meta={"batch_size": self.cfg.batch_size, "repeat_times": self.cfg.repeat_times,
                           "workflow": self.cfg.workflow, "engine": self.cfg.engine.kind,
                           "device": self.cfg.engine.device, "version": self.engine.version},
                     terms=self.config.terms(self.role, self.name)),
            timeout_key="transport.rpc_timeout")  # refused (config_mismatch) unless it agrees
        self._registered_at = time.monotonic()
        self.run_id = reply.run_id
        if reply.reported_batch is not None:
            # a restart: the barrier a snapshot replays may be one this explorer (an earlier
            # incarnation) already reported; a step is reported once, so it is never rolled out
            self._reported_through = max(self._reported_through, reply.reported_batch)
        if reply.granted_batch is not None or reply.reported_batch is not None:
            log.info("explorer.holds", explorer=self.name, granted_step=reply.granted_step,
                     granted_batch=reply.granted_batch, reported_batch=reply.reported_batch)
        return reply

    async def _call_unless_dead(self, msg: Any) -> Any | None:
        """The master's reply to `msg`, or None when the master declared this explorer dead
        (the next barrier wait registers again); any other refusal raises."""
        sent = time.monotonic()
        try:
            return await self.master.call(msg, timeout_key="transport.rpc_timeout")
        except RequestFailed as exc:
            if exc.code != "declared_dead":
                raise
            self._refused_as_dead(sent, type(msg).__name__)
            return None

    def _on_refused(self, exc: RequestFailed) -> None:
        if exc.code == "declared_dead":
            self._refused_as_dead(self.heartbeater.sent_at, "Heartbeat")

    def _refused_as_dead(self, sent: float, what: str) -> None:
        """The master refused a request sent at `sent` (monotonic) with `declared_dead`. Only a
        request sent after the latest registration was answered speaks of this registration: one
        sent before it (a heartbeat in flight while `_register_again` ran, answered after it)
        was refused for the registration that ended, and acting on it would register a live,
        registered explorer again and give up the batch it had just been granted."""
        if sent < self._registered_at:
            log.info("explorer.stale_refusal", explorer=self.name, request=what,
                     why="sent before the explorer registered again")
            return
        self._declared_dead.set()

    async def _register_again(self, why: str) -> None:
        """The master declared this explorer dead while it was alive: register again and take
        the next step it grants (the batch in flight went back to the master)."""
        self._declared_dead.clear()
        self._leases.clear()  # expired with us: the master leased their tasks out again
        log.warning("explorer.declared_dead", explorer=self.name, why=why,
                    hint="raise transport.liveness if the explorer is paused this long")
        await self._register()
        self.rejoins += 1
        log.info("explorer.registered_again", explorer=self.name, times=self.rejoins)

    async def serve(self) -> None:
        """Roll out steps until the master says stop, the tasks run out, or `request_stop()`;
        the caller then calls `close()`."""
        if self._stopping:
            return  # stopped before it began: nothing to load or register
        # a stop while registering (the master may not be up yet) ends the wait at once
        self._wait_task = asyncio.create_task(self.start())
        try:
            await self._wait_task
        except asyncio.CancelledError:
            if self._stopping:
                return
            raise
        if self.cfg.role == "eval":
            # no barriers, leases or puts (eval_role.py)
            follower = WeightFollower(
                self.name, engine=self.engine, evaluator=self.evaluator,
                subscriber=self.subscriber, loader=self.loader, tracer=self.tracer,
                timeout=self.config.sync.timeout, evaluate=self._evaluate,
                stopping=lambda: self._stopping)
            try:
                await follower.run()
            finally:
                self.stop_reason = follower.stop_reason
            return
        try:
            await self._roll_steps()
        except PeerDead as exc:
            if not self._stopping:
                raise
            log.warning("explorer.peer_gone", explorer=self.name, peer=exc.peer, error=str(exc),
                        why="stopping; the master's lease expiry hands its tasks out again")
            return
        if self.evaluator is not None and self.evaluator.cfg.at_end and not self._stopping:
            await self._evaluate_at_end()

    async def _roll_steps(self) -> None:
        """Steps until the run stops. With `lease_ahead` the next barrier is waited for while
        the step in flight drains (asked for once it frees a slot), so two steps overlap."""
        flight: _Flight | None = None  # the newest step started; it awaits the one before
        try:
            while not self._stopping:
                if flight is not None:
                    if self.lease_ahead:
                        await _first(flight.freed.wait(), flight.task)
                    if flight.task.done() or not self.lease_ahead:
                        more, flight = await self._settled(flight), None
                        if not more:
                            return
                    else:
                        await self._ask_ahead(flight)
                if self._stopping:
                    break
                self._wait_task = asyncio.create_task(self._next_barrier(busy=flight))
                if flight is not None:
                    await _first(self._wait_task, flight.task)
                    if flight.task.done() and not self._wait_task.done():
                        more, flight = await self._settled(flight), None  # its report is in
                        if not more:
                            return
                try:
                    barrier = await self._wait_task
                except asyncio.CancelledError:
                    if self._stopping:
                        break
                    raise
                if barrier is None:
                    if flight is not None:  # the run is over: the step in flight is not needed
                        flight.task.cancel()
                        await asyncio.gather(flight.task, return_exceptions=True)
                        flight = None
                    return
                if self._stopping:
                    break
                self._taken_batches.add(barrier.batch)
                prev, flight = flight, _Flight(barrier, self.rejoins, flight)
                flight.task = asyncio.create_task(self._run_step(flight, prev))
                self._flight = flight
        finally:
            if self._wait_task is not None and not self._wait_task.done():
                self._wait_task.cancel()
            if flight is not None and not flight.task.done():
                if not self._stopping:  # an error outside the step: it is given up
                    flight.task.cancel()
                # SIGTERM: it drains, cancelled after drain_seconds (request_stop)
                result, = await asyncio.gather(flight.task, return_exceptions=True)
                if isinstance(result, asyncio.CancelledError):
                    self._abandoned(flight)
                    await self._release_lease("explorer stopped mid-step")
                elif isinstance(result, BaseException):
                    log.error("explorer.step_failed", explorer=self.name,
                              step=flight.barrier.step, error=repr(result))

    async def _settled(self, flight: _Flight) -> bool | None:
        """`flight`'s result once it ends: whether there is more to roll out; None when the
        drain after SIGTERM cancelled it (its leases are handed back)."""
        try:
            return await flight.task
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            self._abandoned(flight)
            await self._release_lease("explorer stopped mid-step")
            return None

    def _abandoned(self, flight: _Flight) -> None:
        log.warning("explorer.step_abandoned", explorer=self.name, step=flight.barrier.step,
                    why="drain_seconds passed after SIGTERM; its tasks go back to the master")

    async def _ask_ahead(self, flight: _Flight) -> None:
        """Tell the master `flight`'s step drains, so it may grant the next one now."""
        b = flight.barrier
        sent = time.monotonic()
        try:
            await self.master.call(ExplorerDraining(explorer=self.name, step=b.step,
                                                    batch=b.batch),
                                   timeout_key="transport.rpc_timeout")
        except RequestFailed as exc:
            if exc.code == "declared_dead":
                self._refused_as_dead(sent, "ExplorerDraining")
            else:  # the next barrier comes after the report, as without lease_ahead
                log.warning("explorer.ahead_refused", explorer=self.name, error=str(exc))

    @property
    def _lease_id(self) -> str | None:
        """The newest lease not yet completed."""
        return next(reversed(self._leases.values()), None)

    async def _release_lease(self, reason: str) -> None:
        """Hand unfinished leases back at once (best effort: if the master cannot be reached,
        a lease returns when it expires)."""
        leases, self._leases = list(self._leases.values()), {}
        for lease_id in leases:
            try:
                await self.master.call(ReleaseTasks(lease_id=lease_id, reason=reason),
                                       timeout=2.0, retries=0)
            except (PeerDead, RequestFailed) as exc:
                log.warning("explorer.release_failed", lease=lease_id, error=str(exc))

    def request_stop(self) -> None:
        """Stop after the running step (at most `drain_seconds` more); from a signal handler."""
        if self._stopping:
            return
        self._stopping = True
        # what the step's drain, a lease handed back or a heartbeat still sends is one attempt
        # of at most transport.liveness per peer: a master or buffer stopping at the same time
        # (every pod deleted, a plain scancel) costs that once, not rpc_retries x rpc_timeout
        # per call. What it could not report is not lost: the lease expires and its tasks are
        # leased out again; experiences already put are stored once (ids name the task)
        for client in (self.master, self.buffer):
            client.bound_for_stop(self.config.transport.liveness, "transport.liveness")
        log.info("explorer.stopping", explorer=self.name, drain_seconds=self.cfg.drain_seconds,
                 peer_bound=self.config.transport.liveness)
        if self._wait_task is not None and not self._wait_task.done():
            self._wait_task.cancel()
        flight = self._flight
        if flight is not None and not flight.task.done():
            if not flight.leased and (flight.prev is None or flight.prev.task.done()):
                # it holds no tasks yet (it waits for weights, or its turn to lease), and no
                # step before it drains: nothing to finish, so nothing waits on a trainer that
                # is stopping too
                flight.task.cancel()
            else:
                asyncio.get_running_loop().call_later(self.cfg.drain_seconds, flight.task.cancel)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # what was done is on disk before the teardown, which a supervisor may cut short with a
        # SIGKILL (vLLM's shutdown alone takes seconds)
        self.tracer.flush()
        if self.heartbeater is not None:
            await self.heartbeater.close()
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.loader is not None:
            await self.loader.close()
        if self.endpoint is not None:
            await self.endpoint.close()
        if self._warm_up is not None:
            self._warm_up.cancel()
            await asyncio.gather(self._warm_up, return_exceptions=True)
        if self.scorer is not None and self._owns_scorer:
            await self.scorer.close()
        if self.run_id:  # registered: the master, past a Stop, waits for this or stop_grace
            await say_goodbye(self.master, self.name, self.config.master.stop_grace)
        await self.master.close()
        await self.buffer.close()
        if self.engine is not None and self._owns_engine:
            self.engine.close()
        self.metrics.close()
        self.tracer.close()
        log.info("explorer.closed", explorer=self.name, steps=self.steps_done,
                 reason=self.stop_reason or ("signal" if self._stopping else "done"))

    # -- one step ------------------------------------------------------------------------------

    async def _next_barrier(self, busy: _Flight | None = None) -> Barrier | None:
        """The barrier of this explorer's next step, or None when the run stops.

        The wait fails after `sync.timeout` without anything that moves the run forward: its
        barrier, a trainer step released (`trainer` topic) or a weights version published.
        A long run of trainer steps (an explorer far ahead, or done and waiting for `Stop`) is
        progress, so only a stalled run fails; so is a step of this explorer still running
        (`busy`, with `lease_ahead`).
        """
        timeout = self.config.sync.timeout
        deadline = time.monotonic() + timeout
        start = time.time()
        while True:
            if self._declared_dead.is_set():
                await self._register_again("a heartbeat was refused while waiting for a barrier")
                deadline = time.monotonic() + timeout
            remaining = deadline - time.monotonic()
            try:
                # in slices of a second or less, so a refused heartbeat is acted on at once
                event = self._held.popleft() if self._held else await self.subscriber.recv(
                    min(max(remaining, 0.0), 1.0), what=f"barrier for {self.name} (master)",
                    timeout_key="sync.timeout")
            except WaitTimeout:
                if busy is not None and not busy.task.done():
                    deadline = time.monotonic() + timeout
                if time.monotonic() < deadline:
                    continue
                dead = (f" (the master declared it dead {self.rejoins} times and it registered "
                        "again)" if self.rejoins else "")
                raise WaitTimeout(
                    f"{self.name}: no barrier and no trainer progress from the master at "
                    f"{self.subscriber.address} for {timeout:g}s after step {self.steps_done}"
                    f"{dead}; are the master and the trainer running? raise sync.timeout if "
                    "they are only slow") from None
            msg = event.body
            if isinstance(msg, Stop):
                self.stop_reason = msg.reason
                log.info("explorer.stop_received", explorer=self.name, reason=msg.reason, ok=msg.ok)
                return None
            if isinstance(msg, (TrainerGo, WeightsPublished)):
                deadline = time.monotonic() + timeout
                if isinstance(msg, WeightsPublished):
                    self._latest_weights = msg
                    if msg.method == "nccl":
                        self.loader.offer_group(msg.rendezvous)
                continue
            if isinstance(msg, Barrier) and msg.explorer == self.name:
                if msg.batch in self._taken_batches or msg.batch <= self._reported_through:
                    continue  # a repeat (snapshot after a gap or a restart) of a step started
                self.tracer.record("wait", start, time.time(), step=msg.step, version=msg.version,
                                   reason="barrier")
                return msg

    async def _run_step(self, flight: _Flight, prev: _Flight | None = None) -> bool:
        """Roll out `flight`'s step, after `prev` (still draining, or None) has reported;
        False when there is nothing left to roll out."""
        try:
            more = await self._step(flight, prev)
        except BaseException:
            if prev is not None:
                prev.task.cancel()
                await asyncio.gather(prev.task, return_exceptions=True)
            raise
        finally:
            flight.freed.set()
            flight.generated.set()
        if prev is not None:
            await prev.task  # reported first (its error, if any, is this step's too)
        return more

    async def _step(self, flight: _Flight, prev: _Flight | None) -> bool:
        barrier = flight.barrier
        engine = self.engine
        lease: TaskLease | None = None
        if prev is not None:  # ahead: lease now, while the step before still generates
            flight.leased = True
            lease = await self._lease(barrier)
            if lease is None or not lease.tasks:
                return lease is None
        if self._inflight_load is not None:  # begun as the last step ended: done, or failed
            load, self._inflight_load = self._inflight_load, None
            await load
        # interruptible: the engine may already hold a newer version than the master granted
        # (loaded mid-step); an older one is never loaded back
        leasing: asyncio.Task | None = None
        if (barrier.version > engine.version if self.interrupt
                else barrier.wait or barrier.version != engine.version or self._asleep):
            if lease is None and (self.evaluator is None
                                  or not self.evaluator.due(barrier.version)):
                # the step's tasks are leased while its weights load: the lease's round trip
                # leaves the path from the trainer's publish to this rollout (issue 27 item 2)
                leasing = asyncio.create_task(self._lease(barrier))
            try:
                if prev is not None:  # weights never change under the step before's generation
                    await _first(prev.generated.wait(), prev.task)
                rendezvous = self._latest_weights.rendezvous if self._latest_weights else None
                await self._wake(barrier.step, barrier.version)
                with self.tracer.span("sync", step=barrier.step, version=barrier.version,
                                      method=barrier.method) as attrs:
                    stats = await self.loader.load(barrier.version, barrier.method, rendezvous)
                    attrs.update(stats)
            except BaseException:
                if leasing is not None:  # a lease it got is handed back with the step's
                    leasing.cancel()
                    await asyncio.gather(leasing, return_exceptions=True)
                raise
        if self.evaluator is not None and self.evaluator.due(engine.version):
            if prev is not None:
                await _first(prev.generated.wait(), prev.task)
            await self._evaluate(step=barrier.step)
        if lease is None:
            flight.leased = True
            lease = await (leasing if leasing is not None else self._lease(barrier))
            if lease is None or not lease.tasks:
                return lease is None
        ctx = RolloutContext(engine=engine, sampling=self.sampling,
                             repeat_times=self.cfg.repeat_times, explorer=self.name,
                             run=self.run_id, step=barrier.step,
                             scorer=self.scorer,
                             version=(max(barrier.version, engine.version) if self.interrupt
                                      else barrier.version),
                             endpoint=self.endpoint)
        t0 = time.time()
        streamed: set[str] = set()
        scored = 0
        images = _images_of(lease.tasks)
        if self.streaming:
            async def put_group(group: list[Experience]) -> None:
                nonlocal scored
                scored += 1
                flight.freed.set()  # the engine has a free slot: the next step may start
                if scored == len(lease.tasks):
                    flight.generated_at = time.time()
                    flight.generated.set()
                await self._put(group, barrier, images)
                streamed.update(e.group_id for e in group)
                self.tracer.record("group", t0, time.time(), step=barrier.step,
                                   version=group[0].policy_version, group=group[0].group_id,
                                   experiences=len(group))
            ctx.on_group = put_group
        watcher = asyncio.create_task(self._watch_weights(barrier)) if self.interrupt else None
        with self.tracer.span("rollout", step=barrier.step, version=barrier.version,
                              tasks=len(lease.tasks)) as attrs:
            try:
                experiences = await self.workflow.run(lease.tasks, ctx)
            finally:
                if watcher is not None:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
            rollout_s = time.time() - t0
            if flight.generated_at is None:
                flight.generated_at = time.time()
            flight.generated.set()
            metrics = step_metrics(experiences, rollout_s)
            # the timeline and `tandem up` read the step's reward and size from its span
            attrs.update(experiences=len(experiences), groups=len(lease.tasks),
                         reward_mean=round(metrics["reward_mean"], 6),
                         tokens=int(metrics["generated_tokens"]),
                         generated=round(flight.generated_at, 6))  # its last group scored
        # groups the workflow did not stream (it cannot, or streaming is off) go now
        rest = [e for e in settle_group_versions(experiences) if e.group_id not in streamed]
        if rest:
            await self._put(rest, barrier, images)
        if prev is not None:
            await prev.task  # reports go in grant order
        if barrier.sleep_after:
            # before the report: the report releases the trainer onto this engine's devices
            with self.tracer.span("sleep", step=barrier.step, version=engine.version) as attrs:
                attrs.update(await engine.sleep())
            self._asleep = True
        if self.rejoins != flight.rejoins or self._declared_dead.is_set():
            # declared dead while it ran: its batch was given up (its tasks are rolled out
            # again and stored once), and the master no longer expects its report
            self._leases.pop(barrier.batch, None)
            return True
        # The report completes the step's task lease first (`lease_id`): one round trip. A
        # lease that ran out during a slow rollout, or went with a declaration of death, is the
        # master's warning: the experiences are stored, and a re-roll of the same tasks (ids
        # name the task's place in the run) stores nothing new.
        done = ExplorerStepDone(explorer=self.name, step=barrier.step, version=barrier.version,
                                batch=barrier.batch, experiences=len(experiences),
                                informative=informative_groups(experiences), metrics=metrics,
                                lease_id=lease.lease_id)
        reported = await self._call_unless_dead(done)
        self._leases.pop(barrier.batch, None)
        if reported is None:
            return True  # the batch was given up; its tasks are rolled out again, stored once
        self.steps_done += 1
        log.info("explorer.step", explorer=self.name, step=barrier.step, batch=barrier.batch,
                 version=barrier.version, experiences=len(experiences),
                 seconds=round(rollout_s, 3), reward=round(metrics["reward_mean"], 4))
        return True

    async def _lease(self, barrier: Barrier) -> TaskLease | None:
        """The step's tasks (none: the taskset ran dry); None when the master declared this
        explorer dead (the next barrier wait registers again) or the barrier's batch was
        reported already (the step is skipped)."""
        try:
            lease = await self._call_unless_dead(
                LeaseTasks(explorer=self.name, count=self.cfg.batch_size, step=barrier.step,
                           batch=barrier.batch))
        except RequestFailed as exc:
            if exc.code != "step_reported":
                raise
            # a stale barrier: rolled out and reported already; no new tasks, no report
            self._reported_through = max(self._reported_through, barrier.batch)
            log.warning("explorer.barrier_stale", explorer=self.name, step=barrier.step,
                        batch=barrier.batch, error=str(exc))
            return None
        if lease is None:
            return None
        if not lease.tasks:
            log.info("explorer.tasks_exhausted", explorer=self.name, step=barrier.step)
        else:
            self._leases[barrier.batch] = lease.lease_id
        return lease

    async def _watch_weights(self, barrier: Barrier) -> None:
        """While a step generates (`on_new_weights: interrupt`): load each newer version the
        trainer publishes as files; the engine switches at its next token boundary. Whatever
        else arrives is kept for the next barrier wait."""
        while True:
            try:
                event = await self.subscriber.recv(1.0, what="weights (master)",
                                                   timeout_key="sync.timeout")
            except WaitTimeout:
                continue
            self._held.append(event)
            msg = event.body
            if not isinstance(msg, WeightsPublished):
                continue
            self._latest_weights = msg
            if msg.method != "checkpoint" or msg.version <= self.engine.version:
                continue
            # shielded: a load the engine took stays taken when the step ends meanwhile; the
            # next step awaits it (and raises its error)
            self._inflight_load = asyncio.ensure_future(self.loader.load(msg.version,
                                                                         "checkpoint"))
            with self.tracer.span("sync", step=barrier.step, version=msg.version,
                                  method="checkpoint", interrupt=True) as attrs:
                attrs.update(await asyncio.shield(self._inflight_load))
            self._inflight_load = None
            log.info("explorer.weights_in_flight", explorer=self.name, step=barrier.step,
                     version=msg.version)

    async def _evaluate(self, *, step: int | None, final: bool = False) -> None:
        """The eval tasksets on the weights the engine holds (between steps: no lease open)."""
        version = self.engine.version
        with self.tracer.span("eval", step=step, version=version, final=final) as attrs:
            rows = await self.evaluator.evaluate(self.engine, self.workflow, self.scorer,
                                                 version=version, step=step, final=final,
                                                 endpoint=self.endpoint)
            attrs.update(tasks=sum(r["tasks"] for r in rows),
                         **{f"{r['taskset']}/{k}": v for r in rows
                            for k, v in r["metrics"].items()})
        for row in rows:
            log.info("explorer.eval", explorer=self.name, version=version, final=final,
                     taskset=row["taskset"], seconds=row["seconds"], **row["metrics"])

    async def _wake(self, step: int | None, version: int) -> None:
        """An asleep engine takes memory for `version`, which the caller loads next."""
        if not self._asleep:
            return
        with self.tracer.span("wake", step=step, version=version) as attrs:
            attrs.update(await self.engine.wake())
        self._asleep = False

    async def _evaluate_at_end(self) -> None:
        """The run is over: evaluate the newest weights this explorer can have. A version
        published as files after its last step is loaded first; a broadcast one cannot be
        (its group is gone), so the held weights are evaluated."""
        latest = self._latest_weights
        if self._asleep and (latest is None or latest.version <= self.engine.version):
            # colocated, and the run ended early (the taskset ran dry after a step that put
            # the engine to sleep): the weights it held went with its sleep
            log.warning("explorer.eval_skipped", explorer=self.name, version=self.engine.version,
                        why="the engine is asleep and no newer version was published")
            return
        if (latest is not None and latest.method == "checkpoint"
                and latest.version > self.engine.version):
            await self._wake(self.steps_done, latest.version)
            with self.tracer.span("sync", step=self.steps_done, version=latest.version,
                                  method="checkpoint") as attrs:
                attrs.update(await self.loader.load(latest.version, "checkpoint"))
        await self._evaluate(step=self.steps_done, final=True)

    async def _put(self, experiences: list[Experience], barrier: Barrier,
                   images: dict[str, bytes]) -> None:
        """Put to the buffer and wait for its ack; a `full` buffer is retried until put_timeout.
        Each put carries the bytes of the images its experiences show, once each (`images`:
        the step's tasks' images by content hash)."""
        # groups are repeat_times experiences, except where a workflow says otherwise (an
        # agent's episode that became one experience per call): one put per group size
        sizes: dict[int, list[Experience]] = {}
        for e in experiences:
            sizes.setdefault(int(e.info.get("group_size", self.cfg.repeat_times)), []).append(e)
        for size, part in sizes.items():
            shown = {h for e in part for h in e.images}
            await self._put_sized(PutExperiences(
                experiences=part, group_size=size,
                images={h: np.frombuffer(images[h], dtype=np.uint8) for h in sorted(shown)}),
                barrier)

    async def _put_sized(self, msg: PutExperiences, barrier: Barrier) -> None:
        deadline = time.monotonic() + self.cfg.put_timeout
        while True:
            try:
                # a resend, or a put retried after `full`, never waits past put_timeout
                await self.buffer.call(msg, timeout_key="transport.rpc_timeout",
                                       deadline=deadline, deadline_key="explorers[].put_timeout")
                failpoints.reached("explorer.put_acked")
                return
            except RequestFailed as exc:
                if exc.code != "full":
                    raise
                wait = exc.retry_after or 0.1
                if time.monotonic() + wait > deadline:
                    raise WaitTimeout(
                        f"{self.name}: the buffer at {self.buffer.address} stayed full for "
                        f"{self.cfg.put_timeout:g}s (explorers[].put_timeout); is the trainer "
                        "consuming? raise buffer.capacity or put_timeout") from None
                start = time.time()
                await asyncio.sleep(wait)
                self.tracer.record("wait", start, time.time(), step=barrier.step,
                                   version=barrier.version, reason="buffer_full")


def _images_of(tasks: list[Task]) -> dict[str, bytes]:
    """The normalised bytes of the tasks' images (docs/vision.md) by content hash."""
    return {image_hash(b): b for t in tasks for b in t.payload.get("images") or ()}


class _Flight:
    """One step in flight: its barrier, and how far its engine work has gone."""

    def __init__(self, barrier: Barrier, rejoins: int, prev: _Flight | None = None):
        self.barrier = barrier
        self.rejoins = rejoins  # the explorer's registrations when it started
        self.prev = prev  # the step before, still draining when this one started
        self.leased = False  # it asked for its tasks: a stop lets it drain
        self.freed = asyncio.Event()  # a group is scored: a slot of the engine is free
        self.generated = asyncio.Event()  # every group is scored: the engine is done with it
        self.generated_at: float | None = None
        self.task: asyncio.Task | None = None


async def _first(*aws: Any) -> None:
    """Wait until the first of `aws` (coroutines or tasks) is done; the others' coroutines are
    cancelled, tasks are left running."""
    futures = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for a, f in zip(aws, futures):
            if f is not a:
                f.cancel()


def step_metrics(experiences: list[Experience], rollout_s: float) -> dict[str, float]:
    """What an explorer reports with its step: rewards, lengths, throughput."""
    n = max(1, len(experiences))
    generated = sum(int(e.action_mask.sum()) for e in experiences)
    out: dict[str, Any] = {
        "reward_mean": sum(e.reward for e in experiences) / n,
        "response_len_mean": sum(e.response_len for e in experiences) / n,
        "generated_tokens": float(generated),
        "rollout_s": rollout_s,
        "tokens_per_s": generated / rollout_s if rollout_s > 0 else 0.0,
    }
    names = sorted({k for e in experiences for k in e.rewards})
    for k in names:
        out[f"reward/{k}"] = sum(e.rewards.get(k, 0.0) for e in experiences) / n
    return out
