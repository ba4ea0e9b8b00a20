"""Broadcast method: the trainer's rank 0 sends a version to every engine worker in buckets.

One transfer, as both sides see it (keys under the epoch's prefix, see `group`):

1. sender: `open_group(members)` -> a `GroupRendezvous` for the master to announce.
2. each member: `WeightReceiver(rendezvous, name).join()` writes `join/<rank>` and waits.
3. sender, first `broadcast()` of the epoch: waits for every `join/<rank>` (a missing one is
   `PeerDead` naming it), chooses the backend (nccl only if everyone is on CUDA), writes
   `backend`, and everyone builds the group.
4. sender: writes `meta/<seq>` (`BroadcastMeta`: names, dtypes, shapes, bucket layout), then
   one broadcast per bucket; each member counts `progress/<seq>/<rank>` and, at the end,
   writes `done/<seq>/<rank>`, which the sender waits for.

Any failure abandons the epoch (`abandoned` key, backend torn down); the trainer opens a new
one at the next sync point and members that were in the old one join the new one.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

from tandem.common.errors import PeerDead
from tandem.common.messages.weights import (
    BroadcastMeta,
    GroupBackend,
    GroupMember,
    GroupRendezvous,
    TensorSpec,
)

from .group import (
    current_key,
    GroupAbandoned,
    build_backend,
    broadcast,
    decode,
    encode,
    epoch_prefix,
    local_address_towards,
    run_guarded,
    shutdown_backend,
    start_broadcast,
    wait_keys,
)
from .store import StoreClient, StoreServer, StoreUnreachable
from .tensors import WeightsError, check_unique_names, dtype_name, plan_buckets, torch_dtype

log = structlog.get_logger(__name__)

TIMEOUT_KEY = "sync.timeout"


@dataclass(frozen=True)
class BroadcastStats:
    """What one `WeightBroadcaster.broadcast` moved."""

    version: int
    epoch: int
    backend: str
    bytes: int
    buckets: int
    seconds: float


def _bucket_views(flat: torch.Tensor, specs: list[TensorSpec]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for spec in specs:
        numel = 1
        for d in spec.shape:
            numel *= d
        yield spec.name, flat[offset:offset + numel].view(spec.shape)
        offset += numel


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower():
        return f"no progress within {timeout:.1f} s; raise {TIMEOUT_KEY} if they are only slow"
    return f"{exc}".split(" This is typically")[0]


class _Epoch:
    """One group epoch as the sender holds it."""

    def __init__(self, rendezvous: GroupRendezvous, store: dist.Store):
        self.rendezvous = rendezvous
        self.store = dist.PrefixStore(epoch_prefix(rendezvous.session, rendezvous.epoch), store)
        self.pg: Any = None
        self.backend: str | None = None
        self.seq = 0


class WeightBroadcaster:
    """Trainer rank 0's end of the broadcast: hosts the rendezvous store, sends versions.

    Blocking calls; from asyncio, run `broadcast` in a thread. `timeout` bounds each step
    (members joining, each bucket, the final acknowledgements) and is `sync.timeout` in a run.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 device: str | torch.device = "cpu", backend: str = "auto",
                 bucket_bytes: int = 512 * 2**20, timeout: float = 600.0):
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"weights.backend must be auto, gloo or nccl, got {backend!r}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise WeightsError("weights.backend: nccl, but this torch build has no NCCL; use "
                               "auto (gloo without CUDA) or install a CUDA build of torch")
        self.host = host
        self.device = torch.device(device)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        try:
            self._server = StoreServer(host, port)
        except Exception as exc:
            raise WeightsError(f"cannot serve the weight group's rendezvous on {host}:{port} "
                               f"(weights.rendezvous_host/rendezvous_port): {exc}") from None
        self.store = self._server.store  # rank 0 reads and writes its own keys in-process
        self.port = self._server.port
        self.session = secrets.token_hex(16)  # names this trainer process, not a credential
        self.epoch = 0
        self._current: _Epoch | None = None
        self._scratch: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._closed = False

    @classmethod
    def from_config(cls, config, *, device: str | torch.device = "cpu") -> WeightBroadcaster:
        """Build from a `RunConfig` (its `weights` section and `sync.timeout`)."""
        w = config.weights
        return cls(host=w.rendezvous_host, port=w.rendezvous_port, device=device,
                   backend=w.backend, bucket_bytes=w.bucket_bytes, timeout=config.sync.timeout)

    @property
    def rendezvous(self) -> GroupRendezvous | None:
        """The current group; None when there is none, it was abandoned, or a member restarted
        since it formed. None means: `open_group` and announce before the next broadcast."""
        group = self._current
        if group is None or self._restarted(group):
            return None
        return group.rendezvous

    def _restarted(self, group: _Epoch) -> list[str]:
        """Members that signed in again after the group formed (restarted or duplicated)."""
        return [m for rank, m in enumerate(group.rendezvous.members, start=1)
                if group.store.check([f"rejoin/{rank}"])]

    def open_group(self, members: list[str]) -> GroupRendezvous:
        """Start a new epoch for `members` (abandoning the current one); announce the result."""
        if not members or len(set(members)) != len(members):
            raise ValueError(f"group members must be unique and non-empty, got {members}")
        self._abandon(f"replaced by epoch {self.epoch + 1}", failed=False)
        self.epoch += 1
        rendezvous = GroupRendezvous(host=self.host, port=self.port, session=self.session,
                                     store_key=self._server.store_key,
                                     member_secret=self._server.member_secret,
                                     epoch=self.epoch, members=list(members))
        self._current = _Epoch(rendezvous, self.store)
        self.store.set(current_key(self.session), str(self.epoch))
        log.info("weights.group.opened", epoch=self.epoch, members=members,
                 store=f"{self.host}:{self.port}")
        return rendezvous

    def joined(self) -> list[str]:
        """Members of the current group that have signed in so far (for logs and tests)."""
        group = self._current
        if group is None:
            return []
        return [m for rank, m in enumerate(group.rendezvous.members, start=1)
                if group.store.check([f"join/{rank}"])]

    def broadcast(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
                  ) -> BroadcastStats:
        """Send `version` to every member of the current group, or raise and abandon it."""
        group = self._current
        if self._closed:
            raise WeightsError("broadcast() after close()")
        if group is None:
            raise WeightsError("no broadcast group: call open_group(members) and announce it "
                               "before broadcast()")
        start = time.perf_counter()
        tensors = [(n, t.detach()) for n, t in named_tensors]
        check_unique_names(tensors, f"weights broadcast of version {version}")
        try:
            restarted = self._restarted(group)
            if restarted:
                raise PeerDead(restarted[0], (
                    f"weights broadcast of version {version}: {restarted} restarted after "
                    f"{self._where(group)} formed; open a new group and announce it"))
            if group.pg is None:
                self._build(group, version)
            moved, buckets = self._send(group, version, tensors)
        except BaseException as exc:
            self._abandon(f"version {version} failed: {exc}")
            raise
        stats = BroadcastStats(version=version, epoch=group.rendezvous.epoch,
                               backend=group.backend or "", bytes=moved, buckets=buckets,
                               seconds=time.perf_counter() - start)
        log.info("weights.broadcast", version=version, epoch=stats.epoch, backend=stats.backend,
                 bytes=stats.bytes, buckets=stats.buckets, seconds=round(stats.seconds, 3))
        return stats

    def _where(self, group: _Epoch) -> str:
        return f"group epoch {group.rendezvous.epoch} at {self.host}:{self.port}"

    def _build(self, group: _Epoch, version: int) -> None:
        members = group.rendezvous.members
        keys = [f"join/{rank}" for rank in range(1, len(members) + 1)]
        missing = wait_keys(group.store, keys, self.timeout, self._closing)
        if missing:
            names = [members[int(k.split("/")[1]) - 1] for k in missing]
            raise PeerDead(names[0], (
                f"weights broadcast of version {version}: member(s) {names} did not join "
                f"{self._where(group)} within {self.timeout:.1f} s; raise {TIMEOUT_KEY} if "
                "they are slow to start, or check that they received the rendezvous"))
        joined = [decode(group.store.get(k), GroupMember, k) for k in keys]
        for rank, member in enumerate(joined, start=1):
            if member.name != members[rank - 1] or member.rank != rank:
                raise WeightsError(f"weight group epoch {group.rendezvous.epoch}: rank {rank} "
                                   f"belongs to {members[rank - 1]!r}, {member.name!r} took it")
        backend = self.backend
        if backend == "auto":
            on_cuda = self.device.type == "cuda" and all(m.device == "cuda" for m in joined)
            backend = "nccl" if on_cuda else "gloo"
        group.store.set("backend", encode(GroupBackend(backend=backend), "backend"))
        store = dist.PrefixStore("pg/", group.store)
        try:
            group.pg = run_guarded(
                lambda: build_backend(backend, store, 0, group.rendezvous.world_size,
                                      device=self.device, bind_host=self.host,
                                      timeout=self.timeout),
                self.timeout, lambda: None, self._closing)
        except GroupAbandoned:
            raise
        except Exception as exc:
            raise PeerDead(members[0], (
                f"weights broadcast of version {version}: building the {backend} group with "
                f"{members} in {self._where(group)} failed: {_why(exc, self.timeout)}")) from None
        group.backend = backend
        log.info("weights.group.ready", epoch=group.rendezvous.epoch, backend=backend,
                 members=[f"{m.name}@{m.host}:{m.pid}" for m in joined])

    def _send(self, group: _Epoch, version: int, tensors: list[tuple[str, torch.Tensor]]
              ) -> tuple[int, int]:
        comm = self.device if group.backend == "nccl" else torch.device("cpu")
        specs = [TensorSpec(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape))
                 for n, t in tensors]
        order, buckets = plan_buckets(specs, self.bucket_bytes)
        seq = group.seq
        meta = BroadcastMeta(version=version, seq=seq, tensors=[specs[i] for i in order],
                             buckets=buckets)
        group.store.set(f"meta/{seq}", encode(meta, f"meta/{seq}"))
        ranks = range(1, group.rendezvous.world_size)
        total = 0
        # Pack bucket b+1 while bucket b is on the wire: two scratch buffers per dtype take
        # turns, so the copy that flattening costs hides behind the transfer.
        in_flight: tuple[int, Any] | None = None
        for b, bucket in enumerate(buckets):
            members = [tensors[order[i]][1]
                       for i in range(bucket.first, bucket.first + bucket.count)]
            flat = self._pack(members, bucket.numel, torch_dtype(bucket.dtype), comm, slot=b % 2)
            if in_flight is not None:
                self._finish(group, version, seq, in_flight, len(buckets))
            in_flight = (b, start_broadcast(group.pg, flat))
            total += flat.numel() * flat.element_size()
        if in_flight is not None:
            self._finish(group, version, seq, in_flight, len(buckets))
        done = [f"done/{seq}/{r}" for r in ranks]
        missing = wait_keys(group.store, done, self.timeout, self._closing)
        if missing:
            names = [group.rendezvous.members[int(k.rsplit("/", 1)[1]) - 1] for k in missing]
            raise PeerDead(names[0], (
                f"weights broadcast of version {version}: {names} did not confirm it in "
                f"{self._where(group)} within {self.timeout:.1f} s; raise {TIMEOUT_KEY} if "
                "loading is only slow"))
        group.seq += 1
        return total, len(buckets)

    def _finish(self, group: _Epoch, version: int, seq: int, in_flight: tuple[int, Any],
                buckets: int) -> None:
        b, collective = in_flight
        try:
            collective.result(self.timeout, lambda: shutdown_backend(group.pg), self._closing)
        except GroupAbandoned:
            raise
        except Exception as exc:
            ranks = range(1, group.rendezvous.world_size)
            lagging = [group.rendezvous.members[r - 1] for r in ranks
                       if group.store.add(f"progress/{seq}/{r}", 0) <= b]
            peers = lagging or group.rendezvous.members
            raise PeerDead(peers[0], (
                f"weights broadcast of version {version}: bucket {b + 1}/{buckets} did not "
                f"reach {peers} in {self._where(group)}: {_why(exc, self.timeout)}")) from None

    def _pack(self, members: list[torch.Tensor], numel: int, dtype: torch.dtype,
              device: torch.device, slot: int) -> torch.Tensor:
        if len(members) == 1 and members[0].device == device and members[0].is_contiguous():
            return members[0].reshape(-1)  # a bucket of one tensor goes without a copy
        # Scratch buffers (two per dtype) are reused bucket after bucket and version after
        # version: fresh memory would cost a page fault per 4 KiB on every sync.
        scratch = self._scratch.get((dtype, slot))
        if scratch is None or scratch.numel() < numel or scratch.device != device:
            scratch = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[(dtype, slot)] = scratch
        flat = scratch[:numel]
        offset = 0
        for t in members:
            n = t.numel()
            flat[offset:offset + n].copy_(t.reshape(-1))
            offset += n
        return flat

    def _abandon(self, reason: str, *, failed: bool = True) -> None:
        group, self._current = self._current, None
        if group is None:
            return
        try:
            group.store.set("abandoned", reason.encode())
        except Exception as exc:
            log.warning("weights.group.mark_failed", epoch=group.rendezvous.epoch, error=str(exc))
        if group.pg is not None:
            shutdown_backend(group.pg)
        (log.warning if failed else log.info)(
            "weights.group.abandoned", epoch=group.rendezvous.epoch, reason=reason)

    def _closing(self) -> str | None:
        return "the trainer closed its broadcaster" if self._closed else None

    def close(self) -> None:
        """Abandon the current group and stop serving the store; a `broadcast` blocked in
        another thread raises GroupAbandoned within half a second."""
        self._closed = True
        self._abandon("the trainer closed its broadcaster", failed=False)
        self._scratch.clear()
        self._server.close()
        self.store = None  # type: ignore[assignment]


class WeightReceiver:
    """An engine worker's end of the broadcast: joins one epoch, yields each version's tensors.

    `join()` once per epoch, then `receive()` per transfer; its iterator goes straight into the
    engine's `load_weights`. Consume it to the end: the group moves in lockstep, and an iterator
    left half-way abandons this member's place in it.

    Each yielded tensor is a view of its bucket. With `reuse_buffers` (what an engine whose
    `load_weights` copies each tensor as it comes should use: vLLM's and `load_into` do) one
    buffer per dtype is received into again and again, so a view is only valid until the
    iterator moves past its bucket; without it every bucket is fresh memory the views keep
    alive, which costs a page fault per 4 KiB received.
    """

    def __init__(self, rendezvous: GroupRendezvous | dict, member: str, *,
                 device: str | torch.device = "cpu", timeout: float = 600.0,
                 reuse_buffers: bool = False):
        self.rendezvous = (rendezvous if isinstance(rendezvous, GroupRendezvous)
                           else GroupRendezvous.model_validate(rendezvous))
        if member not in self.rendezvous.members:
            raise WeightsError(f"{member!r} is not a member of weight group epoch "
                               f"{self.rendezvous.epoch} (members: {self.rendezvous.members})")
        self.member = member
        self.rank = self.rendezvous.members.index(member) + 1
        self.device = torch.device(device)
        self.timeout = timeout
        self.backend: str | None = None
        self._root: StoreClient | None = None  # held while a group built on it lives
        self._store: dist.Store | None = None
        self._pg: Any = None
        self._seq = 0
        self._broken: str | None = None
        self.reuse_buffers = reuse_buffers
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._closed = False

    @property
    def epoch(self) -> int:
        return self.rendezvous.epoch

    @property
    def healthy(self) -> bool:
        return self._pg is not None and self._broken is None

    def matches(self, rendezvous: GroupRendezvous | dict) -> bool:
        """Whether `rendezvous` is the group this receiver is for (same trainer, same epoch):
        compare with this, not the epoch alone, since a restarted trainer counts from 1 again."""
        if isinstance(rendezvous, dict):
            rendezvous = GroupRendezvous.model_validate(rendezvous)
        return rendezvous == self.rendezvous

    def _trainer(self) -> str:
        r = self.rendezvous
        return f"trainer (rank 0, store {r.host}:{r.port}, group epoch {r.epoch})"

    def _abandoned(self) -> str | None:
        if self._closed:
            return f"weight group member {self.member} was closed"
        store = self._store
        if store is not None and store.check(["abandoned"]):
            reason = store.get("abandoned").decode(errors="replace")
            return f"the trainer abandoned weight group epoch {self.epoch}: {reason}"
        return None

    def join(self) -> None:
        """Sign in, wait for the trainer's backend choice, and build the group."""
        r = self.rendezvous
        self._close_store()
        root = self._root = StoreClient(r.host, r.port, r.store_key, r.member_secret,
                                        self.timeout)
        try:
            signed_in = root.check([current_key(r.session)])
        except StoreUnreachable:
            raise PeerDead("trainer", f"weight group: cannot reach the {self._trainer()} within "
                                      f"{self.timeout:.1f} s ({TIMEOUT_KEY})") from None
        if not signed_in:
            raise GroupAbandoned(f"weight group epoch {r.epoch} belongs to a trainer that has "
                                 "restarted since; join the rendezvous the master announced last")
        current = root.get(current_key(r.session)).decode()
        if current != str(r.epoch):
            raise GroupAbandoned(
                f"weight group epoch {r.epoch} was replaced by epoch {current}; join the "
                "rendezvous the master announced last")
        self._store = dist.PrefixStore(epoch_prefix(r.session, r.epoch), root)
        reason = self._abandoned()
        if reason is not None:
            raise GroupAbandoned(reason)
        if self._store.check([f"join/{self.rank}"]):
            # An earlier incarnation of this member signed in: that group was formed without
            # this process. Tell the trainer, which then opens a new epoch.
            self._store.set(f"rejoin/{self.rank}", str(os.getpid()).encode())
            raise GroupAbandoned(
                f"weight group epoch {r.epoch} already has a {self.member} (this one restarted "
                "or joined twice); the trainer opens a new epoch at its next sync point")
        me = GroupMember(name=self.member, rank=self.rank,
                         device="cuda" if self.device.type == "cuda" else "cpu",
                         host=socket.gethostname(), pid=os.getpid())
        self._store.set(f"join/{self.rank}", encode(me, f"join/{self.rank}"))
        if wait_keys(self._store, ["backend"], self.timeout, self._abandoned):
            raise PeerDead("trainer", f"weight group: the {self._trainer()} did not start the "
                                      f"group within {self.timeout:.1f} s ({TIMEOUT_KEY})")
        self.backend = decode(self._store.get("backend"), GroupBackend, "backend").backend
        bind = local_address_towards(r.host, r.port)
        store = dist.PrefixStore("pg/", self._store)
        try:
            self._pg = run_guarded(
                lambda: build_backend(self.backend, store, self.rank, r.world_size,
                                      device=self.device, bind_host=bind, timeout=self.timeout),
                self.timeout, lambda: None, self._abandoned)
        except GroupAbandoned:
            raise
        except Exception as exc:
            raise PeerDead("trainer", f"weight group: building the {self.backend} group with the "
                                      f"{self._trainer()} failed: {exc}") from None
        log.info("weights.group.joined", epoch=r.epoch, member=self.member, rank=self.rank,
                 backend=self.backend)

    def receive(self, version: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Wait for the next transfer's metadata, then yield its tensors bucket by bucket.

        `version`, when given, must be what the trainer sends (a mismatch means this member and
        the trainer disagree about the sync plan: a WeightsError, and the member leaves).
        """
        if self._broken is not None:
            raise GroupAbandoned(f"weight group epoch {self.epoch} is unusable: {self._broken}")
        if self._pg is None:
            raise WeightsError("receive() before join(): join the group first")
        store = self._store
        key = f"meta/{self._seq}"
        try:
            if wait_keys(store, [key], self.timeout, self._abandoned):
                raise PeerDead("trainer", f"weight group: no weights from the {self._trainer()} "
                                          f"within {self.timeout:.1f} s ({TIMEOUT_KEY})")
        except GroupAbandoned as exc:
            self._fail(str(exc))
            raise
        meta = decode(store.get(key), BroadcastMeta, key)
        if version is not None and meta.version != version:
            self._fail(f"expected version {version}, the trainer sends {meta.version}")
            raise WeightsError(f"weight group epoch {self.epoch}: this member expects version "
                               f"{version}, the trainer broadcasts {meta.version}")
        return self._buckets(meta)

    def _buckets(self, meta: BroadcastMeta) -> Iterator[tuple[str, torch.Tensor]]:
        comm = self.device if self.backend == "nccl" else torch.device("cpu")
        start = time.perf_counter()
        finished = False
        try:
            for b, bucket in enumerate(meta.buckets):
                flat = self._buffer(bucket.numel, torch_dtype(bucket.dtype), comm)
                try:
                    broadcast(self._pg, flat, self.timeout, self._abandoned)
                except GroupAbandoned:
                    raise
                except Exception as exc:
                    raise PeerDead("trainer", (
                        f"weight group: bucket {b + 1}/{len(meta.buckets)} of version "
                        f"{meta.version} did not arrive from the {self._trainer()}: "
                        f"{_why(exc, self.timeout)}")) from None
                self._store.add(f"progress/{meta.seq}/{self.rank}", 1)
                specs = meta.tensors[bucket.first:bucket.first + bucket.count]
                yield from _bucket_views(flat, specs)
            self._store.set(f"done/{meta.seq}/{self.rank}", b"1")
            finished = True
        finally:
            if not finished:
                self._fail(f"transfer of version {meta.version} stopped half-way")
        self._seq += 1
        log.info("weights.loaded", version=meta.version, method="broadcast", epoch=self.epoch,
                 buckets=len(meta.buckets), seconds=round(time.perf_counter() - start, 3))

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if not self.reuse_buffers:
            return torch.empty(numel, dtype=dtype, device=device)
        scratch = self._scratch.get(dtype)
        if scratch is None or scratch.numel() < numel:
            scratch = self._scratch[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return scratch[:numel]

    def _fail(self, reason: str) -> None:
        self._broken = reason
        if self._pg is not None:
            shutdown_backend(self._pg)
            self._pg = None

    def _close_store(self) -> None:
        root, self._root, self._store = self._root, None, None
        if root is not None:
            root.close()

    def close(self) -> None:
        """Leave the group (the trainer notices at its next transfer and opens a new epoch).

        A `join` or `receive` blocked in another thread raises GroupAbandoned within half a
        second, so an explorer shutting down never waits out `sync.timeout`."""
        self._closed = True
        self._fail("member closed")
        self._scratch.clear()
        self._close_store()
