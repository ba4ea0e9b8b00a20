"""Bringing new weights into an engine, by checkpoint files (or shared-memory segments) or by
joining the trainer's broadcast.

Both end in `engine.update_weights`, which runs on the engine's thread: a broadcast bucket is
received and copied into the model without a detour, and never while a batch is generating.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
import structlog

from tandem.common.messages.weights import GroupRendezvous
from tandem.weights import (
    GroupAbandoned,
    WeightReceiver,
    WeightSubscriber,
    WeightsError,
    engine_member,
)

from .engine import Engine, TensorEngine, WorkerFetchEngine

log = structlog.get_logger(__name__)


class NoGroupAnnounced(WeightsError):
    """A broadcast load with no weight group naming this engine announced (yet)."""


class WeightLoader:
    """One explorer's way to new weights: `await load(version, method, rendezvous)`."""

    def __init__(self, engine: Engine, *, run_dir: str | Path, explorer: str, timeout: float,
                 device: str = "cpu", fetcher=None, shared_memory: bool = False):
        if not isinstance(engine, (TensorEngine, WorkerFetchEngine)):
            raise TypeError(f"{type(engine).__name__} is neither a TensorEngine nor a "
                            "WorkerFetchEngine: it has no way to take new weights")
        if shared_memory and not isinstance(engine, TensorEngine):
            raise WeightsError(f"{explorer}: weights.transport: shared_memory maps versions in "
                               f"the explorer's process, and {type(engine).__name__}'s workers "
                               "load weights in their own; use weights.transport: shared_fs")
        self.engine: TensorEngine | WorkerFetchEngine = engine
        self.subscriber = WeightSubscriber(run_dir)
        self.explorer = explorer
        self.member = engine_member(explorer)
        self.timeout = timeout
        self.device = device
        self.run_dir = str(run_dir)
        self.fetcher = fetcher  # weights.transport: fetch (a tandem.weights.fetch.WeightFetcher)
        self.shared = None  # weights.transport: shared_memory
        if shared_memory:
            from tandem.weights.shm import SharedMemorySubscriber

            self.shared = SharedMemorySubscriber(run_dir)
        self.receiver: WeightReceiver | None = None
        self._joining: asyncio.Task | None = None
        self._worker_group: tuple | None = None  # the group the engine's workers joined

    async def load_checkpoint(self, version: int) -> int:
        """Load `weights/v{version}` (checked against its manifest first)."""
        if self.fetcher is not None:
            # no shared filesystem: bring the version into this explorer's run_dir first
            await self.fetcher.fetch(version)
        if self.shared is not None:
            await self._segment_published(version)
            # views of the mapped segment: the engine's copy into its model is the only one
            return await self.engine.update_weights(lambda: self.shared.load(version), version)
        if isinstance(self.engine, WorkerFetchEngine):
            return await self.engine.fetch_checkpoint(self.run_dir, version)
        return await self.engine.update_weights(lambda: self.subscriber.load(version), version)

    async def _segment_published(self, version: int) -> None:
        """Wait up to `sync.timeout` for `version`'s segment. It is missing only between a
        trainer's death (its segments go with it) and its successor's publish of that version:
        the master may have granted it before it heard of the death."""
        deadline = time.monotonic() + self.timeout
        while not self.shared.exists(version):
            if time.monotonic() > deadline:
                raise WeightsError(
                    f"{self.explorer}: weights version {version} has no shared-memory segment "
                    f"{self.shared.path(version)} after {self.timeout:g}s (in shared memory: "
                    f"{self.shared.versions() or 'none'}); is the trainer on this host and "
                    "running? raise sync.timeout if it is only restarting slowly")
            await asyncio.sleep(0.1)

    def offer_group(self, rendezvous: GroupRendezvous | None) -> None:
        """A rendezvous was announced: join it in the background if it names this engine.

        The trainer's first broadcast of an epoch waits for every member, so joining as soon as
        the group is announced (not at the sync point) keeps that wait short.
        """
        if rendezvous is None or self.member not in rendezvous.members:
            return
        if isinstance(self.engine, WorkerFetchEngine):
            key = (rendezvous.session, rendezvous.epoch)
            if key != self._worker_group:
                if self._joining is not None and not self._joining.done():
                    self._joining.cancel()
                self._worker_group = key
                self._joining = asyncio.create_task(
                    # a plain map: it crosses into vLLM's worker processes
                    self.engine.join_group(rendezvous.model_dump(), self.explorer, self.timeout),
                    name=f"weights-join-{key[1]}")
            return
        if self.receiver is not None and self.receiver.matches(rendezvous):
            return
        if self._joining is not None and not self._joining.done():
            self._joining.cancel()
        self._close_receiver()
        # load_named_tensors copies each tensor at once, so buckets can be reused
        receiver = WeightReceiver(rendezvous, self.member, device=self.device, timeout=self.timeout,
                                  reuse_buffers=True)
        self.receiver = receiver
        self._joining = asyncio.create_task(asyncio.to_thread(receiver.join),
                                            name=f"weights-join-{receiver.epoch}")

    async def load_broadcast(self, version: int, rendezvous: GroupRendezvous | None) -> int:
        """Receive `version` from the trainer's broadcast, joining its group first if needed."""
        self.offer_group(rendezvous)
        if isinstance(self.engine, WorkerFetchEngine):
            if self._worker_group is None:
                raise NoGroupAnnounced(f"{self.explorer}: asked to load version {version} by "
                                   "broadcast but no weight group naming it was announced")
            if self._joining is not None:
                joining, self._joining = self._joining, None
                await joining
            return await self.engine.fetch_broadcast(version)
        if self.receiver is None:
            raise NoGroupAnnounced(f"{self.explorer}: asked to load version {version} by broadcast "
                               "but no weight group naming it was announced (sync.method: nccl "
                               "needs the trainer's rendezvous on the master's `weights` topic)")
        if self._joining is not None:
            joining, self._joining = self._joining, None
            await joining
        receiver = self.receiver
        try:
            return await self.engine.update_weights(lambda: receiver.receive(version), version)
        except GroupAbandoned:
            self._close_receiver()
            raise

    def _on_disk(self, version: int) -> bool:
        """`weights/v{version}` is in place (folders are renamed in whole, manifest included)."""
        from tandem.weights import version_dir

        return self.fetcher is None and version_dir(self.run_dir, version).is_dir()

    async def _broadcast_or_disk(self, version: int, rendezvous: GroupRendezvous | None) -> int:
        """Receive `version` by broadcast, or read it from disk once a trainer wrote it there.

        A trainer that (re)starts at step S under nccl writes its version S to `weights/v{S}`
        (docs/design.md §5: a member that restarts gets the current version by checkpoint): a version
        broadcast before the restart is never broadcast again. An explorer that restarted with
        it may have been granted that version by broadcast before the master heard of the
        checkpoint; it takes it from disk as soon as it is there, within `sync.timeout`."""
        if self._on_disk(version):
            return await self.load_checkpoint(version)
        broadcast = asyncio.ensure_future(self.load_broadcast(version, rendezvous))
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                done, _ = await asyncio.wait({broadcast}, timeout=0.25)
                if done and broadcast.exception() is None:
                    return broadcast.result()
                if self._on_disk(version):
                    break
                if done and (not isinstance(broadcast.exception(), NoGroupAnnounced)
                             or time.monotonic() > deadline):
                    return broadcast.result()  # its error
                if done:
                    await asyncio.sleep(0.25)  # no group announced (yet): the file may come
        finally:
            if not broadcast.done():
                broadcast.cancel()
                await asyncio.gather(broadcast, return_exceptions=True)
        self._close_receiver()  # it waited on a group that will not send this version
        log.info("explorer.weights_from_disk", explorer=self.explorer, version=version,
                 detail="the trainer restarted and wrote this version; it is not broadcast again")
        return await self.load_checkpoint(version)

    async def load(self, version: int, method: str, rendezvous: GroupRendezvous | None = None
                   ) -> dict[str, float]:
        """Load `version` by `method`; returns what the sync span records."""
        start = time.perf_counter()
        if method == "checkpoint":
            tensors = await self.load_checkpoint(version)
        elif method == "nccl":
            tensors = await self._broadcast_or_disk(version, rendezvous)
        else:
            raise ValueError(f"sync.method {method!r}: expected checkpoint or nccl")
        seconds = time.perf_counter() - start
        log.info("explorer.weights_loaded", explorer=self.explorer, version=version,
                 method=method, tensors=tensors, seconds=round(seconds, 3))
        return {"tensors": float(tensors), "seconds": seconds}

    def _close_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    async def close(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.close()
        if self._joining is not None:
            self._joining.cancel()
            await asyncio.gather(self._joining, return_exceptions=True)
            self._joining = None
        self._close_receiver()
