"""The trainer component: the learner, wired to the master, the buffer and the weight path.

On start, rank 0 continues from its newest checkpoint (step S, 0 without one) and puts the run
back at S (docs/design.md §9, docs/trainer.md "Restarts"): `Register` (the master says how many steps T
it counted; S > T is refused), the buffer's `ReleaseLeases` and `RewindTo(S)`, versions after S
moved aside, then `TrainerResumed(S)`: the master releases `TrainerGo` again from S, and steps
S..T-1 are trained again on the same groups.

Per step, on rank 0 (docs/design.md §4, docs/master.md):

    TrainerGo(step t, publish p)            from the master's PUB socket (topic `trainer`)
    sample whole groups from the buffer     under a lease
    train                                   every rank (the batch is broadcast to them)
    AckLease(step t), TrainerStepDone(t)    the groups are consumed; the master counts the step
    publish p when set                      checkpoint: weights/v{p} + WeightsPublished;
                                            nccl: WeightsPublished(rendezvous), then broadcast
    checkpoint every `trainer.checkpoint_every` steps and at the end (steps the master counted),
                                            then TrainerCheckpointed(step) to the master and
                                            CheckpointSaved(step) to the buffer

Ranks other than 0 follow (`serve()` runs `follow()` there): they wait for rank 0's commands
and join its collectives. Without sockets, `train_step(experiences)` runs one step on a batch
handed in directly. Either way the caller ends with `await close()`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
import torch

from tandem.common import failpoints
from tandem.common.config import RunConfig
from tandem.common.errors import PeerDead, RequestFailed, TandemError, WaitTimeout
from tandem.common.messages.buffer import (
    AckLease, CheckpointSaved, ReleaseLease, ReleaseLeases, RewindTo, SampleGroups,
    SampleResult)
from tandem.common.messages.experience import Experience
from tandem.common.messages.master import (
    Register, Registered, Stop, TrainerCheckpointed, TrainerGo, TrainerResumed, TrainerStepDone,
    WeightsPublished)
from tandem.common.trace import Tracer
from tandem.weights import model_dtype

from . import checkpoint
from . import distributed as dd
from .learner import Learner
from .metrics import MetricsWriter

log = structlog.get_logger(__name__)


class TrainerStopped(TandemError):
    """The trainer was asked to stop while waiting."""


class Trainer:
    """`Trainer(config)`: `train_step(experiences)` alone, or `await serve()` against a live run;
    then `await close()`.

    It continues from the newest checkpoint in `run_dir/checkpoints` (`resume=False`: from
    `model.path`, for a trainer used without a run). Each instance is a new lineage: the id its
    checkpoints carry.
    """

    name = "trainer"  # the name it registers under, and the buffer's lease holder

    def __init__(self, config: RunConfig, *, resume: bool = True,
                 dist_info: dd.DistInfo | None = None):
        self.config = config
        self.tc = config.trainer
        self.dist = dist_info or dd.from_env()
        self.run_dir = Path(config.run_dir)
        self.checkpoint_root = self.run_dir / "checkpoints"
        self.lineage = uuid.uuid4().hex[:12]
        resume_from = checkpoint.latest(self.checkpoint_root) if resume else None
        self.resumed_from = resume_from
        self.learner = Learner(config, dist_info=self.dist, resume_from=resume_from)
        main = self.dist.is_main
        self.tracer = Tracer(self.run_dir if (main and config.logging.trace) else None, "trainer")
        self.writer = MetricsWriter(self.run_dir if main else None, self.tc.tensorboard,
                                    config=config, tracer=self.tracer)
        self.last_checkpoint_step = self.learner.step_count if resume_from else None
        self._trained_through = self.learner.step_count - 1  # the master's step count
        self._counted = self.learner.step_count  # steps the master acknowledged
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        # the steps and the weight copies on their path run on this one thread (`_compute`)
        self._compute_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_use: list[int] = []
        self._ahead: _SampleAhead | None = None  # the next step's sample, asked for early
        self._publishing: asyncio.Task | None = None  # a version written behind the next step
        self._publisher = None
        # weights.lora_transfer: adapter: versions are peft adapter folders, not full weights
        self._adapters = (config.model.lora is not None
                          and config.weights.lora_transfer == "adapter")
        self._run_over = False  # the master's Stop said the run is done
        self._broadcaster = None
        self._weight_server = None  # weights.transport: fetch
        self._master = self._buffer = self._sub = self._heartbeat = None

    @property
    def step(self) -> int:
        return self.learner.step_count

    def request_stop(self) -> None:
        """Finish the current step, then stop; a wait (for the master, the buffer) ends at once.

        Safe from a signal handler and from another thread.
        """
        self._stopping = True
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
            self._loop.call_soon_threadsafe(self._bound_calls)

    def _bound_calls(self) -> None:
        """Stopping: each call still made (the step's reports, the exit checkpoint's, a
        heartbeat) is one attempt of at most transport.liveness per peer, so a master or buffer
        that stops at the same time costs that once (`RpcClient.bound_for_stop`). The exit
        checkpoint is written to disk before any of its reports."""
        for client in (self._master, self._buffer):
            if client is not None:
                client.bound_for_stop(self.config.transport.liveness, "transport.liveness")

    async def _unless_stopped(self, coro):
        """Await `coro`, or cancel it and raise TrainerStopped when a stop is requested.

        Under torchrun the other ranks get a keepalive while rank 0 waits here.
        """
        task = asyncio.ensure_future(coro)
        stopped = asyncio.ensure_future(self._stop_event.wait())
        try:
            while True:
                done, _ = await asyncio.wait({task, stopped}, timeout=dd.KEEPALIVE_SECONDS,
                                             return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if stopped in done:
                    raise TrainerStopped("stop requested while waiting")
                if self.dist.enabled:
                    await asyncio.to_thread(dd.send_command, dd.KEEPALIVE)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # -- without sockets -----------------------------------------------------------------------

    def train_step(self, experiences: Sequence[Experience], *, step: int | None = None,
                   extra_batches: int = 0, images: dict[str, bytes] | None = None,
                   write: bool = True) -> dict[str, float]:
        """One step on these experiences; under torchrun, rank 0 calls it and the others follow.
        `extra_batches`: the master's top-up batches in them (dynamic sampling); `images`: the
        bytes of the images they show, by content hash (docs/vision.md); `write=False`: the
        caller passes the metrics to the trackers (`writer.write`) itself."""
        if self.dist.enabled and any(e.images for e in experiences):
            raise TandemError("trainer: experiences with images under torchrun are not built "
                              "yet (the images do not travel to the other ranks); train a "
                              "vision-language model in one process (docs/vision.md)")
        if self.dist.enabled:
            dd.send_command(dd.STEP)
            experiences = dd.broadcast_experiences(list(experiences))
        step = self.learner.step_count if step is None else step
        start = time.time()
        metrics = self.learner.step(experiences, images)
        discarded = {}
        if self.tc.dynamic_sampling:
            metrics["dynamic_sampling/extra_batches"] = float(extra_batches)
            # consumed with the step (acked) but not trained: no group-relative signal
            discarded = dict(discarded_groups=int(metrics["dynamic_sampling/dropped_groups"]),
                             extra_batches=extra_batches)
        # the trainer/engine mismatch of the step's tokens and the student's reverse KL to a
        # teacher, next to its timing in the trace
        traced = {name.replace("/", "_"): round(value, 8) for name, value in metrics.items()
                  if name.startswith(("mismatch/", "teacher/"))}
        self.tracer.record("train", start, time.time(), step=step, version=self.learner.version,
                           tokens=int(metrics["batch/tokens"]),
                           loss=round(metrics.get("loss/total", 0.0), 6), **discarded, **traced)
        if write:
            self.writer.write(self.learner.step_count, metrics)
        log.info("train.step", step=step, version=self.learner.version,
                 loss=round(metrics.get("loss/total", float("nan")), 5),
                 reward=round(metrics["reward/mean"], 4),
                 tokens_per_s=round(metrics.get("throughput/tokens_per_s", 0.0), 1))
        return metrics

    def save_checkpoint(self) -> Path | None:
        if self.dist.enabled:
            dd.send_command(dd.CHECKPOINT)
        path = checkpoint.save(self.learner, self.checkpoint_root, lineage=self.lineage)
        self.last_checkpoint_step = self.learner.step_count
        return path

    async def _checkpoint(self) -> None:
        """Save, then tell the master (the run is done only once a checkpoint holds every step
        it counted) and the buffer (groups consumed before this step can never be rewound)."""
        # traced: a stop's bound is `up.stop_timeout` plus this span (tests/e2e/test_stop.py)
        with self.tracer.span("checkpoint", step=self.step, stopping=self._stopping):
            path = await self._compute(self.save_checkpoint)
        try:
            await self._master.call(TrainerCheckpointed(step=self.step, checkpoint=str(path)),
                                    timeout_key="transport.rpc_timeout")
        except (PeerDead, RequestFailed) as exc:
            # the master then ends the run as failed (master.final_checkpoint_wait), never done
            log.warning("checkpoint.unreported", to="master", step=self.step, error=str(exc))
        try:
            await self._buffer.call(CheckpointSaved(step=self.step), retries=0,
                                    timeout_key="transport.rpc_timeout")
        except (PeerDead, RequestFailed) as exc:
            # only retention waits for it: the buffer keeps the rows until the next report
            log.warning("checkpoint.unreported", to="buffer", step=self.step, error=str(exc))

    def policy_weights(self, copy: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The policy's weights to publish: HF names, `model.dtype`, each tied weight once (with
        `weights.lora_transfer: adapter`, the adapters only, under peft's names), without a
        frozen vision tower (engines keep theirs: it never changes). `copy`: tensors of their
        own, which the next optimiser step does not change."""
        if self.dist.enabled:
            dd.send_command(dd.PUBLISH)
        if self._adapters:
            dtype = model_dtype(self.config.model.dtype)
            return [(n, t.to(dtype, copy=copy))
                    for n, t in self.learner.adapter_state_dict().items()]
        state = self.learner.policy_state_dict()
        tied = getattr(self.learner.actor.model.config, "tie_word_embeddings", False)
        dtype = model_dtype(self.config.model.dtype)
        frozen = self.learner.frozen_prefix()
        seen: set[int] = set()
        out = []
        for name, tensor in state.items():
            if (tied and name == "lm_head.weight") or tensor.data_ptr() in seen:
                continue
            if frozen is not None and name.startswith(frozen):
                continue
            seen.add(tensor.data_ptr())
            out.append((name, tensor.to(dtype, copy=copy)))
        return out

    def follow(self) -> None:
        """Ranks > 0: join rank 0's steps, publications and checkpoints until it stops."""
        while True:
            command, _ = dd.recv_command()
            if command == dd.STEP:
                self.learner.step(dd.broadcast_experiences(None))
            elif command == dd.PUBLISH:
                if self._adapters:
                    self.learner.adapter_state_dict()
                else:
                    self.learner.policy_state_dict()
            elif command == dd.CHECKPOINT:
                self.learner.save_checkpoint(self.checkpoint_root)
            elif command == dd.STOP:
                return
            # KEEPALIVE: rank 0 is waiting for the master or the buffer

    # -- against a live run --------------------------------------------------------------------

    async def serve(self) -> None:
        """Rank 0: train the steps the master releases until it says stop (or `request_stop`).

        Other ranks follow rank 0 until it stops; a signal does not stop them on its own (rank 0
        decides when the group stops, then releases them from its `close()`).
        """
        if not self.dist.is_main:
            self.follow()  # blocks this rank's loop on purpose: it has nothing else to serve
            return
        from tandem.common.heartbeat import Heartbeater
        from tandem.common.pubsub import Subscriber
        from tandem.common.rpc import RpcClient

        cfg = self.config
        transport = cfg.transport
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stopping:
            self._stop_event.set()
        self._master = RpcClient(cfg.master.address, peer="master", transport=transport)
        self._buffer = RpcClient(cfg.buffer.address, peer="buffer", transport=transport)
        if self._stopping:
            self._bound_calls()
        try:
            log.info("trainer.connecting", master=cfg.master.address, buffer=cfg.buffer.address)
            registered = await self._unless_stopped(self._master.call(
                Register(name=self.name, role="trainer", pid=os.getpid(),
                         host=socket.gethostname(),
                         meta={"world_size": self.dist.world_size, "step": self.step,
                               "lineage": self.lineage},
                         terms=cfg.terms("trainer", self.name)),
                timeout_key="transport.rpc_timeout"))  # refused (config_mismatch) unless it agrees
            await self._unless_stopped(self._resume_run(registered))
            self._sub = Subscriber(registered.publish_address or cfg.master.publish_address,
                                   topics=["trainer", "stop"], transport=transport,
                                   snapshot=self._master)
            await self._sub.start()
            # the master's liveness, so both sides agree on when silence means death
            self._heartbeat = Heartbeater(self._master, name="trainer", role="trainer",
                                          interval=registered.heartbeat_interval,
                                          liveness=registered.liveness)
            self._heartbeat.start()
            if cfg.weights.transport == "fetch":
                # explorers share no filesystem with the trainer: they fetch versions from here
                from tandem.weights.fetch import WeightServer

                self._weight_server = WeightServer.from_config(cfg)
                await self._weight_server.start()
            # the checkpoint's state-dict API, imported while the first batch is rolled out
            # rather than at start-up or in the end-of-run checkpoint
            threading.Thread(target=checkpoint.import_state_dict_api, daemon=True,
                             name="import-state-dict-api").start()
            log.info("trainer.started", run_id=registered.run_id, step=self.step,
                     world_size=self.dist.world_size, device=str(self.learner.device))
            while not self._stopping:
                event = await self._unless_stopped(self._next_event())
                if event is None:
                    break
                await self._run_step(event)
        except TrainerStopped:
            pass
        except PeerDead as exc:
            if not self._stopping:
                raise
            # a step trained but not counted: the resume trains it again (the checkpoint never
            # gets ahead of the master's count)
            log.warning("trainer.peer_gone", peer=exc.peer, error=str(exc), why="stopping")
        finally:
            await self._drop_ahead()
            if self._publishing is not None:  # announced before the exit checkpoint
                try:
                    await self._published()
                except (PeerDead, RequestFailed) as exc:
                    log.warning("weights.unannounced", error=str(exc))
            # only steps the master counted: a checkpoint never gets ahead of the journal
            if self.step > 0 and self.last_checkpoint_step != self.step \
                    and self.step == self._counted:
                await self._checkpoint()
            await self._close_clients()
            log.info("trainer.stopped", step=self.step, requested=self._stopping)

    async def _resume_run(self, registered: Registered) -> None:
        """Put the run back at this learner's step S: the buffer makes the groups consumed at
        steps >= S sampleable again (and drops the dead incarnation's leases), versions after S
        are moved aside, and the master releases TrainerGo from S again."""
        start, counted = self.step, registered.trainer_steps
        where = "model.path" if self.resumed_from is None else f"checkpoint {self.resumed_from}"
        if start > counted:
            raise TandemError(
                f"trainer: {where} holds {start} trainer steps but the master counted only "
                f"{counted}; the master's journal ({self.run_dir / self.config.master.journal}) "
                "lost them, or the run dir holds another run's checkpoints: restore the journal, "
                "or start the run in a new run_dir")
        rpc = "transport.rpc_timeout"
        released = await self._buffer.call(ReleaseLeases(holder=self.name), timeout_key=rpc)
        rewound = await self._buffer.call(RewindTo(step=start), timeout_key=rpc)
        superseded = await asyncio.to_thread(self._supersede_versions, start)
        await self._master.call(TrainerResumed(
            step=start, checkpoint=None if self.resumed_from is None else str(self.resumed_from),
            lineage=self.lineage), timeout_key=rpc)
        method = self.config.sync.method
        # shared_memory: the lost incarnation's segments went with it (docs/weights.md)
        in_memory = self.config.weights.transport == "shared_memory"
        if start > 0 and (method == "nccl" or superseded or in_memory):
            # checkpoint: the master's newest version is now at most S, and retention may have
            # deleted v{S}: an explorer that (re)starts loads the newest, so v{S} must exist.
            # nccl: versions up to S went by in broadcasts of the lost incarnation and are
            # never broadcast again; an explorer that restarted with this trainer takes v{S}
            # from disk (docs/design.md §5: the current version by checkpoint). The learner is at
            # version S exactly; it writes v{S} when missing, and announces it.
            # shared_memory: no segment outlives its trainer, so v{S} is always written again.
            path = await self._compute(self._current_version, start)
            await self._master.call(WeightsPublished(version=start, method="checkpoint",
                                                     path=str(path)), timeout_key=rpc)
        if counted > start:
            began = "resumed from" if self.resumed_from else "no checkpoint: started from"
            detail = (f"{began} {where}; master had counted {counted}; retraining "
                      f"{start}..{counted - 1}")
        elif start:
            detail = f"resumed from {where}; the master counted the same {counted} steps"
        else:
            detail = "starting from model.path at step 0"
        log.info("trainer.resume", step=start, master_counted=counted, lineage=self.lineage,
                 groups_rewound=rewound.groups, leases_released=released.leases
                 + rewound.leases_released, versions_superseded=superseded, detail=detail)

    def _current_version(self, version: int) -> Path:
        """`weights/v{version}` (or its segment), written from the learner (at that version)
        if missing."""
        from tandem.weights import version_dir

        if self.config.weights.transport == "shared_memory":
            existing = self._weights_publisher().path(version)
            return existing if existing.exists() else self._publish_checkpoint(version)
        existing = version_dir(self.run_dir, version)
        return existing if existing.is_dir() else self._publish_checkpoint(version)

    def _supersede_versions(self, start: int) -> list[int]:
        """Move aside `weights/v{N}` for N > start: a lost lineage wrote them, and this one
        publishes its own. Renamed first, then deleted, as retention does: an explorer that has
        a version open keeps reading it through its open files."""
        from tandem.weights import list_versions, version_dir

        newer = [v for v in list_versions(self.run_dir) if v > start]
        for version in newer:
            folder = version_dir(self.run_dir, version)
            trash = folder.with_name(f".trash-superseded-v{version}-{uuid.uuid4().hex[:8]}")
            os.rename(folder, trash)
            shutil.rmtree(trash, ignore_errors=True)
        if newer:
            log.warning("weights.superseded", versions=newer, resumed_at=start,
                        detail="published by a lineage that was lost; this one publishes its own")
        return newer

    async def _next_event(self) -> TrainerGo | None:
        """The next TrainerGo not yet trained; None on Stop or request_stop."""
        deadline = time.monotonic() + self.tc.idle_timeout
        waited_from = time.time()
        while not self._stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"no TrainerGo from the master at {self.config.master.address} "
                                  f"within {self.tc.idle_timeout:g}s; raise trainer.idle_timeout "
                                  f"if the explorers are only slow")
            try:
                event = await self._sub.recv(timeout=min(1.0, remaining), what="TrainerGo",
                                             timeout_key="trainer.idle_timeout")
            except WaitTimeout:
                continue
            if isinstance(event.body, Stop):
                stop = event.body
                if not stop.ends(self.step):
                    # re-sent by a restarted master before this trainer's resume re-opened
                    # the run: the steps after its checkpoint are trained again first
                    log.info("trainer.stop_ignored", reason=stop.reason, stop_steps=stop.steps,
                             step=self.step)
                    continue
                log.info("trainer.stop", reason=stop.reason)
                self._run_over = stop.ok
                return None
            go = event.body
            if not isinstance(go, TrainerGo) or go.step <= self._trained_through:
                continue  # a repeat (snapshot after a gap or a restart): already trained
            if time.time() - waited_from > 0.01:
                self.tracer.record("wait", waited_from, time.time(), step=go.step,
                                   what="trainer_go")
            return go
        return None

    async def _run_step(self, go: TrainerGo) -> None:
        if go.step != self.step:
            raise TandemError(f"trainer: the master released step {go.step} but the learner is "
                              f"at step {self.step} (lineage {self.lineage}); the master's and "
                              "the learner's step counts must agree")
        self._in_use = list(go.in_use)
        groups = go.groups or self.tc.groups_per_step
        sample = await self._take_ahead(go, groups)
        if sample is None:
            sample = await self._unless_stopped(self._sample(groups, go.step))
        failpoints.reached("trainer.leased")
        metrics = await self._compute(
            self.train_step, sample.experiences, step=go.step, extra_batches=go.extra_batches,
            images={h: v.tobytes() for h, v in sample.images.items()}, write=False)
        written = dict(metrics)
        self._trained_through = go.step
        metrics["buffer/dropped_stale"] = float(sample.dropped_stale)
        if go.publish is not None and self._announced_with_count(go):
            start = time.time()
            preparing = asyncio.ensure_future(self._prepare_version(go.publish, go))
            await self._report_step(go.step, sample.lease_ids, metrics, written, preparing,
                                    ahead=groups)
            published, moved, then = preparing.result()
            if then is not None:
                await then()
            self.tracer.record("sync", start, time.time(), step=go.step, version=go.publish,
                               method=published.method, bytes=moved)
        else:
            await self._report_step(go.step, sample.lease_ids, metrics, written, ahead=groups)
            if go.publish is not None:
                await self._publish(go.publish, go)
        every = self.tc.checkpoint_every
        if every and self.step % every == 0:
            await self._checkpoint()

    async def _report_step(self, step: int, lease_ids: list[str], metrics: dict[str, float],
                           written: dict[str, float],
                           writing: asyncio.Future[tuple[WeightsPublished, Any]] | None = None,
                           *, ahead: int | None = None) -> None:
        """The step's groups consumed (buffer) and the step counted (master), both at once: two
        peers, so one round trip between the spans instead of two (issue 27 item 2); the
        trackers get `written` on a thread meanwhile (a few ms of TensorBoard and JSONL that
        were on the path). `writing`: the next version being prepared (`_prepare_version`); the
        count waits for it and carries its announcement, while the ack goes at once. The step
        counts for the exit checkpoint only when both were answered: a checkpoint never holds a
        step whose groups were not acked (they would be trained again) or that the master did
        not count; a crash between the two leaves what a crash between them did before (the
        resume releases the lease, rewinds the acks, and trains the step again).

        The next step's `ahead` groups are asked for right after the ack is sent (`_ask_ahead`),
        so the buffer's answer travels while this step is reported and published instead of
        after the next TrainerGo (issue 27 item 2); after the ack, not before it: the buffer
        serves its requests in order, and the ack waited 12 ms behind the lease and encoding of
        a sample whose groups were ready."""
        async def count() -> object:
            published = None if writing is None else (await writing)[0]
            return await self._master.call(
                TrainerStepDone(step=step, version=step + 1, metrics=metrics, published=published),
                timeout_key="transport.rpc_timeout")

        ack = asyncio.ensure_future(self._buffer.call(
            AckLease(lease_id=lease_ids[0], more=lease_ids[1:], step=step),
            timeout_key="transport.rpc_timeout"))
        if ahead is not None:
            self._ask_ahead(step + 1, ahead)
        acked, counted, wrote = await asyncio.gather(
            ack, count(), asyncio.to_thread(self.writer.write, step + 1, written),
            return_exceptions=True)
        for result in (acked, counted, wrote):
            if isinstance(result, BaseException):
                raise result
        self._counted = step + 1

    def _ask_ahead(self, step: int, groups: int) -> None:
        """Lease step `step`'s groups before its TrainerGo (`_SampleAhead`). Not with dynamic
        sampling (the master sizes each step's groups from the batches it kept), and not past
        the run's last step."""
        total = self.config.master.total_steps
        if self.tc.dynamic_sampling or (total is not None and step >= total):
            return
        self._ahead = _SampleAhead(step, groups, self._gathers_in_parts())
        self._ahead.task = asyncio.create_task(self._sample_ahead(self._ahead))

    def _gathers_in_parts(self) -> bool:
        """Whether a step's groups are leased as they become ready (`_SampleAhead`): under the
        fifo policy in a plan with sync points, where the groups leased in parts are the ones
        a whole lease at the end would pick (the oldest first), so only when they travel
        changes. The newest and priority policies choose among all the groups there are."""
        return self.config.buffer.policy == "fifo" and self.config.sync.offset is not None

    async def _sample_ahead(self, ahead: _SampleAhead) -> _Leased | None:
        """`SampleGroups` for `ahead`'s step, each held by the buffer up to the same bound as
        `_sample`'s, asked again on `not_enough` until the step's TrainerGo arrives (then the
        request in flight is the last); None when the step's groups were not all leased (the
        parts leased are given back). In parts (`_gathers_in_parts`): each answer leases the
        groups ready then, and the rest are asked for at once; a part's lease is held for the
        rest of the step's rollout too (`buffer.lease_seconds` plus
        `master.task_lease_seconds`, which bounds a rollout)."""
        rpc_timeout = self.config.transport.rpc_timeout
        lag = self.tc.drop_older_than
        parts = ahead.parts
        lease_seconds = (self.config.buffer.lease_seconds + self.config.master.task_lease_seconds
                         if ahead.in_parts else None)
        while True:
            have = sum(len(p.group_ids) for p in parts)
            if have >= ahead.groups:
                return _Leased(parts)
            try:
                parts.append(await self._buffer.call(
                    SampleGroups(num_groups=ahead.groups - have, holder=self.name,
                                 min_groups=1 if ahead.in_parts else None,
                                 lease_seconds=lease_seconds,
                                 wait=min(self.tc.sample_wait, rpc_timeout / 2),
                                 min_version=None if lag is None else max(0, ahead.step - lag)),
                    timeout=rpc_timeout, timeout_key="transport.rpc_timeout"))
            except RequestFailed as exc:
                if exc.code != "not_enough" or ahead.released or self._stopping:
                    await self._give_back(ahead)
                    return None

    async def _give_back(self, ahead: _SampleAhead) -> None:
        """Release the parts `ahead` leased, one by one: the step before may not be acked yet,
        so not every lease of this holder (best effort: a lease not released expires, and a
        resumed trainer releases its holder's)."""
        parts, ahead.parts = ahead.parts, []
        for part in parts:
            try:
                await self._buffer.call(ReleaseLease(lease_id=part.lease_id), retries=0,
                                        timeout_key="transport.rpc_timeout")
            except (PeerDead, RequestFailed) as exc:
                log.warning("trainer.part_unreleased", step=ahead.step, lease=part.lease_id,
                            error=str(exc))

    async def _take_ahead(self, go: TrainerGo, groups: int) -> _Leased | None:
        """The groups asked for ahead of `go`, when that request was for this step and this
        many groups; otherwise (a resume, fewer groups at the taskset's end) what it leased is
        given back and None says: sample now."""
        ahead = self._ahead
        if ahead is None:
            return None
        ahead.released = True
        start = time.time()
        sample = await self._unless_stopped(ahead.task)  # a stop leaves it to _drop_ahead
        self._ahead = None
        if sample is not None and (ahead.step, ahead.groups) != (go.step, groups):
            # the trainer holds no other lease: the step before was acked
            await self._buffer.call(ReleaseLeases(holder=self.name),
                                    timeout_key="transport.rpc_timeout")
            return None
        if sample is not None and time.time() - start > 0.01:
            self.tracer.record("wait", start, time.time(), step=go.step, what="sample",
                               groups=groups, ahead=True)
        return sample

    async def _drop_ahead(self) -> None:
        """Stopping: the request asked ahead ends; a lease it got is given back (best effort: a
        resumed trainer releases its holder's leases anyway)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.task is None:
            return
        ahead.released = True
        if not ahead.task.done():
            ahead.task.cancel()
        await asyncio.gather(ahead.task, return_exceptions=True)
        if ahead.parts:  # what it leased, all of the step's groups or a cancelled gather's part
            try:
                await self._buffer.call(ReleaseLeases(holder=self.name), retries=0,
                                        timeout_key="transport.rpc_timeout")
            except (PeerDead, RequestFailed) as exc:
                log.warning("trainer.ahead_unreleased", step=ahead.step, error=str(exc))

    async def _sample(self, groups: int, step: int) -> _Leased:
        """Lease `groups` whole groups, waiting up to `trainer.idle_timeout` for them.

        Every wait here counts against a bound: the buffer holds a request at most half of
        `transport.rpc_timeout` (so its `not_enough` comes well inside that bound, and a stalled
        buffer is silent for `rpc_timeout` per attempt, not `sample_wait` more), and no request
        is sent, or waited for, past `idle_timeout`."""
        rpc_timeout = self.config.transport.rpc_timeout
        wait = min(self.tc.sample_wait, rpc_timeout / 2)
        deadline = time.monotonic() + self.tc.idle_timeout
        start = time.time()
        while True:
            try:
                lag = self.tc.drop_older_than
                result = await self._buffer.call(
                    SampleGroups(num_groups=groups, wait=wait, holder=self.name,
                                 min_version=None if lag is None else max(0, step - lag)),
                    timeout=rpc_timeout, timeout_key="transport.rpc_timeout",
                    deadline=deadline, deadline_key="trainer.idle_timeout")
                break
            except RequestFailed as exc:
                if exc.code != "not_enough" or time.monotonic() > deadline:
                    if exc.code == "not_enough":
                        raise WaitTimeout(f"buffer at {self.config.buffer.address} had not "
                                          f"{groups} groups within {self.tc.idle_timeout:g}s ("
                                          f"{exc.message}); raise trainer.idle_timeout") from None
                    raise
        if time.time() - start > 0.01:
            self.tracer.record("wait", start, time.time(), step=step, what="sample", groups=groups)
        return _Leased([result])

    async def _publish(self, version: int, go: TrainerGo) -> None:
        method = go.publish_by or self.config.sync.method
        await self._published()  # versions are announced in order
        start = time.time()
        if method == "checkpoint" and self.config.sync.offset is None and not go.publish_by:
            # asynchronous plans: no explorer waits for this version at a sync point, so only
            # the copy of the weights is on the step's path; the write and the announcement go
            # on while the next step trains (issue 27 item 2)
            tensors = await self._compute(self.policy_weights, True)
            self.tracer.record("sync", start, time.time(), step=go.step, version=version,
                               method=method, behind=True)
            self._publishing = asyncio.create_task(self._publish_behind(version, go, tensors))
            return
        if method == "checkpoint":
            # a lost lineage's version goes to disk once, maybe already at resume
            published, moved = await self._write_version(version, lost=bool(go.publish_by))
            await self._master.call(published, timeout_key="transport.rpc_timeout")
        elif self._stopping:
            # the explorers are stopping too (`tandem up` stops them with the trainer): none
            # would join, and a resume announces v{step} from disk (`_resume_run`)
            log.info("weights.broadcast_skipped", version=version, why="stopping")
            return
        else:
            published, moved, broadcast = await self._prepare_broadcast(version, go)
            await self._master.call(published, timeout_key="transport.rpc_timeout")
            await broadcast()
        self.tracer.record("sync", start, time.time(), step=go.step, version=version, method=method,
                           bytes=moved)

    async def _prepare_broadcast(self, version: int, go: TrainerGo
                                 ) -> tuple[WeightsPublished, int, Callable[[], Awaitable[None]]]:
        """nccl: the weights copied and the group `go`'s explorers join; the announcement (not
        sent here), the bytes, and the broadcast to run once it was sent."""
        from tandem.weights import WeightBroadcaster, engine_members

        if self._broadcaster is None:
            self._broadcaster = WeightBroadcaster.from_config(self.config,
                                                              device=self.learner.device)
        members = [m for name in go.explorers for m in engine_members(name)]
        tensors = await self._compute(self.policy_weights)
        moved = sum(t.numel() * t.element_size() for _, t in tensors)

        def announcement() -> WeightsPublished:
            rendezvous = self._broadcaster.rendezvous
            if rendezvous is None or rendezvous.members != members:
                # a new epoch only when the members change (or the last one failed)
                rendezvous = self._broadcaster.open_group(members)
            return WeightsPublished(version=version, method="nccl", rendezvous=rendezvous)

        async def broadcast() -> None:
            for attempt in (1, 2):
                if attempt == 2:  # a fresh group, announced on its own
                    await self._master.call(announcement(), timeout_key="transport.rpc_timeout")
                try:
                    await self._broadcast_unless_stopped(version, tensors)
                    return
                except PeerDead as exc:
                    # A member that restarted left the epoch; a fresh group lets it rejoin. A
                    # member that stays away fails the step, and a stop does not wait for
                    # members that are leaving.
                    if self._stopping:
                        raise TrainerStopped(f"stop requested while broadcasting version "
                                             f"{version}: {exc}") from None
                    if attempt == 2:
                        raise
                    log.warning("weights.broadcast_retry", version=version, error=str(exc))

        return announcement(), moved, broadcast

    async def _prepare_version(self, version: int, go: TrainerGo
                               ) -> tuple[WeightsPublished, int, Callable[[], Awaitable[None]] | None]:
        """The version `go` asks for, ready to be announced with the step's count: written
        (checkpoint), or copied with its group open (nccl, whose broadcast is returned to run
        after the announcement)."""
        if self.config.sync.method == "checkpoint":
            published, moved = await self._write_version(version)
            return published, moved, None
        return await self._prepare_broadcast(version, go)

    def _announced_with_count(self, go: TrainerGo) -> bool:
        """The version `go` asks for is prepared beside the step's ack and announced with its
        count (`_report_step`): in a plan whose explorers wait for it at a sync point, of this
        lineage, with nothing of an earlier version still in flight, and not while stopping
        (a broadcast is then skipped: no explorer would join)."""
        return (go.publish_by is None and self.config.sync.offset is not None
                and self._publishing is None and not self._stopping)

    async def _write_version(self, version: int, *, lost: bool = False
                             ) -> tuple[WeightsPublished, int]:
        """Write checkpoint `version` (a folder, or a shared-memory segment; `lost`: a lost
        lineage's version, written only if missing); its announcement and the bytes it holds."""
        write = self._current_version if lost else self._publish_checkpoint
        path = Path(await self._compute(write, version))
        moved = (path.stat().st_size if path.is_file()  # a shared-memory segment
                 else sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
        return WeightsPublished(version=version, method="checkpoint", path=str(path)), moved

    async def _publish_behind(self, version: int, go: TrainerGo, tensors) -> None:
        """Write `version` from its copy and announce it; traced as `publish` (off the
        trainer's path, so neither busy time nor a sync on its lane)."""
        start = time.time()
        path = Path(await asyncio.to_thread(self._publish_checkpoint, version, tensors))
        await self._master.call(
            WeightsPublished(version=version, method="checkpoint", path=str(path)),
            timeout_key="transport.rpc_timeout")
        moved = (path.stat().st_size if path.is_file()
                 else sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
        self.tracer.record("publish", start, time.time(), step=go.step, version=version,
                           method="checkpoint", bytes=moved)

    async def _published(self) -> None:
        """The version being written behind the steps is announced (its error is raised)."""
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            await publishing

    async def _broadcast_unless_stopped(self, version: int, tensors) -> None:
        """The broadcast, on a thread; a stop closes the broadcaster, which makes the thread's
        collective or wait for members raise `GroupAbandoned` within half a second, instead of
        waiting `sync.timeout` for explorers that are leaving."""
        sending = asyncio.ensure_future(asyncio.to_thread(self._broadcaster.broadcast, version,
                                                          tensors))
        stopped = asyncio.ensure_future(self._stop_event.wait())
        try:
            await asyncio.wait({sending, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if sending.done():
            sending.result()
            return
        broadcaster, self._broadcaster = self._broadcaster, None
        broadcaster.close()
        await asyncio.gather(sending, return_exceptions=True)  # GroupAbandoned, at once
        raise TrainerStopped(f"stop requested while broadcasting version {version}; the "
                             "explorers are leaving and a resume announces it from disk")

    def _publish_checkpoint(self, version: int, tensors=None) -> Path:
        from tandem.weights import version_dir

        existing = version_dir(self.run_dir, version)
        if existing.exists():
            # versions after the resume step were moved aside at start, and this lineage
            # publishes each version once: this one is not ours, and is never announced as ours
            raise TandemError(f"trainer: weights version {version} already exists at {existing} "
                              f"but lineage {self.lineage} did not write it; versions are "
                              "immutable (was a second trainer started on this run dir?)")
        publisher = self._weights_publisher()
        if self._adapters:  # a peft adapter folder, which vLLM's LoRA API loads as it is
            from tandem.weights.lora import (ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS,
                                             adapter_config_json)

            config = adapter_config_json(self.learner.actor.model.peft_config[ADAPTER])
            return publisher.publish(version, tensors or self.policy_weights(),
                                     single_file=ADAPTER_WEIGHTS,
                                     files={ADAPTER_CONFIG: config}).path
        return publisher.publish(version, tensors or self.policy_weights()).path

    def _weights_publisher(self):
        """Checkpoint versions go to `run_dir/weights`, or with `weights.transport:
        shared_memory` to /dev/shm segments (created once: it clears the run's old segments)."""
        if self._publisher is None:
            if self.config.weights.transport == "shared_memory":
                from tandem.weights.shm import SharedMemoryPublisher as publisher_type
            else:
                from tandem.weights import WeightPublisher as publisher_type
            self._publisher = publisher_type.from_config(self.run_dir, self.config.weights,
                                                         in_use=self._versions_in_use)
        return self._publisher

    def _versions_in_use(self) -> list[int]:
        serving = self._weight_server.serving() if self._weight_server is not None else []
        return [*self._in_use, *serving]

    async def _close_clients(self) -> None:
        if self._weight_server is not None:
            await self._weight_server.close()
            self._weight_server = None
        if self._heartbeat is not None:
            await self._heartbeat.close()
        if self._sub is not None:
            await self._sub.close()
            # registered, its exit checkpoint reported: the master, past a Stop, waits for
            # this or master.stop_grace
            from tandem.common.heartbeat import say_goodbye

            await say_goodbye(self._master, self.name, self.config.master.stop_grace)
        for client in (self._master, self._buffer):
            if client is not None:
                await client.close()

    async def _compute(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the trainer's one compute thread: training steps, the weight
        copies and the versions written on the step's path run on one thread, so the memory
        one step frees is what the next reuses. Spread over the default pool's threads, each
        thread's allocations went to its own malloc arena, and the trainer's peak PSS grew by
        85-95 MiB (tools/bench_peer.py, issue 27 item 1)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._compute_pool, call)

    async def close(self) -> None:
        """Release ranks > 0, flush the trace and TensorBoard, close the weight group.

        The learner lets go of its DDP wrapper here, so that `distributed.shutdown()`, which the
        caller runs last, frees the process group itself (see there).
        """
        self.tracer.flush()  # before a teardown that a supervisor may cut short
        self._compute_pool.shutdown(wait=False)
        if self.dist.enabled and self.dist.is_main:
            dd.send_command(dd.STOP)
        self.learner.release()
        if self._broadcaster is not None:
            self._broadcaster.close()
        self.tracer.close()
        if self._run_over:
            # the evaluating explorer scores the last weights after the same Stop: its rows
            # reach the trackers, which this process owns, before they close
            await self.writer.await_final_eval()
        self.writer.close()
        if self._publisher is not None:
            # after the final eval above: the evaluating explorer loads the newest version
            self._publisher.close()


class _SampleAhead:
    """The next step's `SampleGroups`, sent as the step before finishes training: its groups
    are leased as soon as the buffer has them, so the TrainerGo that releases the step finds
    them here (no sample round trip between the spans). Leased, not consumed: only the step's
    AckLease consumes them, and a lease not used is given back, so nothing is lost or trained
    twice (docs/reliability.md P2)."""

    def __init__(self, step: int, groups: int, in_parts: bool = False):
        self.step, self.groups = step, groups
        self.in_parts = in_parts  # leased as the groups become ready (`_gathers_in_parts`)
        self.parts: list[SampleResult] = []  # the leases so far
        self.released = False  # the step's TrainerGo came: no request after the one in flight
        self.task: asyncio.Task | None = None


@dataclass
class _Leased:
    """A step's groups: one lease, or several gathered in parts (`_SampleAhead`); the step's
    ack consumes them all at once (`AckLease.more`)."""

    parts: list[SampleResult]

    @property
    def lease_ids(self) -> list[str]:
        return [p.lease_id for p in self.parts]

    @property
    def experiences(self) -> list[Experience]:
        return [e for p in self.parts for e in p.experiences]

    @property
    def images(self) -> dict[str, Any]:
        return {h: v for p in self.parts for h, v in p.images.items()}

    @property
    def dropped_stale(self) -> int:
        return sum(p.dropped_stale for p in self.parts)
