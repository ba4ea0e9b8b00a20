"""Shared-memory transport: weight versions as `/dev/shm` segments, for one host.

`weights.transport: shared_memory` (sync.method checkpoint): the trainer copies each version once
into a POSIX shared-memory segment, `/dev/shm/tandem-<run key>-v{N}`; an explorer on the same
host maps it read-only and hands views of it to the engine's `load_weights`, whose copy into the
model is the only one on that side. Layout of a segment:

    b"TANDEMW1" | header length (8 bytes, little endian) | header (JSON: version, each tensor's
    name/dtype/shape/offset) | tensor bytes, each at a 64-byte aligned offset

Lifetimes (docs/weights.md "Shared memory"):
- A version is written under a temporary name and renamed once whole: a reader sees a whole
  version or none. Versions are immutable.
- Retention unlinks versions older than the newest `keep` that no explorer uses (`in_use`, the
  master's registry, as for checkpoint files). An explorer that already mapped one keeps its
  pages until it unmaps them (after its load); then the kernel frees them.
- A killed explorer holds nothing but its mapping, which the kernel drops. Every name the
  trainer creates is registered with Python's multiprocessing resource tracker, a helper
  process that outlives a SIGKILLed trainer and unlinks what it left. A new publisher also
  removes every segment of its run first (one trainer owns a run's segments).

The run key is a hash of the run directory's real path, so the trainer and its explorers find
the same names from `run_dir` and a version number alone, as they find `weights/v{N}`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import time
import uuid
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .checkpoint import PublishedVersion, TensorEntry, _check_no_aliases
from .tensors import WeightsError, check_unique_names, dtype_name, torch_dtype

log = structlog.get_logger(__name__)

SHM_ROOT = Path("/dev/shm")
MAGIC = b"TANDEMW1"
FORMAT = "tandem.weights.shm/1"
_ALIGN = 64
_RTYPE = "shared_memory"  # the resource tracker unlinks these with shm_unlink


class SegmentTensor(TensorEntry):
    """One tensor of a segment: where its bytes start."""

    offset: int = Field(ge=0)


class SegmentHeader(BaseModel):
    """What a segment holds, written at its start."""

    model_config = ConfigDict(extra="forbid")
    format: str = FORMAT
    version: int = Field(ge=0)
    tensors: list[SegmentTensor]
    size: int = Field(ge=0, description="the segment's size in bytes")


def run_key(run_dir: str | Path) -> str:
    """A short name for a run directory: the part every segment name of that run shares."""
    real = os.path.realpath(run_dir)
    return hashlib.blake2b(real.encode(), digest_size=6).hexdigest()


def segment_name(run_dir: str | Path, version: int) -> str:
    return f"tandem-{run_key(run_dir)}-v{version}"


def segment_path(run_dir: str | Path, version: int, root: Path = SHM_ROOT) -> Path:
    return root / segment_name(run_dir, version)


def list_segments(run_dir: str | Path, root: Path = SHM_ROOT) -> list[int]:
    """Every whole version of this run in shared memory, oldest first."""
    pattern = re.compile(rf"^tandem-{run_key(run_dir)}-v(\d+)$")
    found = [int(m.group(1)) for p in _entries(root) if (m := pattern.match(p.name))]
    return sorted(found)


def _entries(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except FileNotFoundError:
        raise WeightsError(f"weights.transport: shared_memory needs {root} (POSIX shared memory, "
                           "Linux); it is missing on this host") from None


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _write_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedMemoryPublisher:
    """Writes weight versions into shared-memory segments (trainer side).

    Same contract as `WeightPublisher`: `publish` returns a `PublishedVersion` (its `path` is the
    segment), calls `announce` once the version is whole, then applies retention with `in_use`.
    `close()` unlinks every segment it made; explorers that mapped one keep their pages.
    """

    def __init__(self, run_dir: str | Path, *, keep: int = 3,
                 announce: Callable[[PublishedVersion], None] | None = None,
                 in_use: Callable[[], Collection[int]] | Collection[int] = (),
                 root: Path = SHM_ROOT):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (weights.keep_versions), got {keep}")
        self.run_dir = Path(run_dir)
        self.root = Path(root)
        self.keep = keep
        self.announce = announce
        self.in_use = in_use
        self.key = run_key(run_dir)
        self._mine: set[str] = set()
        self._remove_leftovers()

    @classmethod
    def from_config(cls, run_dir: str | Path, weights, **kwargs) -> SharedMemoryPublisher:
        """Build from a `WeightsConfig` section (`keep_versions`)."""
        return cls(run_dir, keep=weights.keep_versions, **kwargs)

    def path(self, version: int) -> Path:
        """Where `version`'s segment is (or would be)."""
        return self.root / f"tandem-{self.key}-v{version}"

    def _remove_leftovers(self) -> None:
        # one trainer owns a run's segments: whatever is there was left by an earlier one
        # (its resource tracker killed with it, or a version it was still writing)
        for entry in _entries(self.root):
            if entry.name.startswith(f"tandem-{self.key}-"):
                entry.unlink(missing_ok=True)
                log.info("weights.leftover_removed", path=str(entry))

    def _track(self, name: str) -> None:
        resource_tracker.register("/" + name, _RTYPE)
        self._mine.add(name)

    def _untrack(self, name: str) -> None:
        if name in self._mine:
            self._mine.discard(name)
            resource_tracker.unregister("/" + name, _RTYPE)

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> PublishedVersion:
        """Copy `version` into a new segment, rename it into place, announce it, prune."""
        start = time.perf_counter()
        final = self.path(version)
        if final.exists():
            raise WeightsError(f"weights version {version} already exists at {final}; versions "
                               "are immutable, publish the next one")
        tensors = [(name, t.detach()) for name, t in named_tensors]
        if not tensors:
            raise WeightsError(f"weights version {version}: no tensors to publish")
        check_unique_names(tensors, f"weights version {version}")
        _check_no_aliases(tensors)
        entries, offset = [], 0
        for name, t in tensors:
            entries.append(SegmentTensor(name=name, dtype=dtype_name(t.dtype),
                                         shape=list(t.shape), offset=offset))
            offset = _aligned(offset + t.numel() * t.element_size())
        # the header states absolute offsets, which depend on where the data starts: size it
        # with numbers at least as long as the real ones (a header under 1 TiB, offsets 2**40+)
        probe = SegmentHeader(version=version, size=2**62, tensors=[
            e.model_copy(update={"offset": e.offset + 2**40}) for e in entries])
        data_start = _aligned(16 + len(probe.model_dump_json()))
        size = data_start + offset
        header = SegmentHeader(version=version, tensors=[
            e.model_copy(update={"offset": e.offset + data_start}) for e in entries], size=size)
        raw = header.model_dump_json().encode()
        self._check_room(version, size)
        tmp_name = f"tandem-{self.key}-tmp-v{version}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        tmp = self.root / tmp_name
        self._track(tmp_name)  # from before it exists: a kill at any moment leaves nothing
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                _write_all(fd, MAGIC + len(raw).to_bytes(8, "little") + raw, 0)
                for (name, t), entry in zip(tensors, header.tensors):
                    if t.numel():
                        # the one copy on the trainer's side: pwrite into tmpfs pages, measured
                        # twice as fast as a copy through a fresh writable mapping (whose page
                        # faults or MAP_POPULATE cost more than the copy)
                        flat = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
                        _write_all(fd, memoryview(flat.numpy()), entry.offset)
            finally:
                os.close(fd)
            self._track(final.name)
            os.rename(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._untrack(final.name)
            if exc.errno == errno.ENOSPC:  # another writer took the room after the check
                raise WeightsError(self._no_room(version, size)) from None
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            self._untrack(final.name)
            raise
        finally:
            self._untrack(tmp_name)
        published = PublishedVersion(version=version, path=final, bytes=size,
                                     tensors=len(tensors), shards=1,
                                     seconds=time.perf_counter() - start)
        log.info("weights.published", version=version, path=str(final), bytes=size,
                 transport="shared_memory", seconds=round(published.seconds, 3))
        if self.announce is not None:
            self.announce(published)
        self.prune()
        return published

    def _check_room(self, version: int, size: int) -> None:
        # tmpfs allocates on write: without room the copy would fail half-way through
        stat = os.statvfs(self.root)
        if stat.f_bavail * stat.f_frsize < size:
            raise WeightsError(self._no_room(version, size))

    def _no_room(self, version: int, size: int) -> str:
        stat = os.statvfs(self.root)
        free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
        return (f"weights version {version} needs {size / 2**20:.1f} MiB in {self.root}, which "
                f"has {free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB; give it more "
                "(a container's default is 64 MiB: docker --shm-size, a Kubernetes emptyDir "
                "with medium: Memory) or lower weights.keep_versions")

    def prune(self) -> list[int]:
        """Unlink versions older than the newest `keep` that no explorer uses; returns them."""
        versions = list_segments(self.run_dir, self.root)
        busy = set(self.in_use() if callable(self.in_use) else self.in_use)
        removed = []
        for version in versions[:-self.keep]:
            if version in busy:
                continue
            self._unlink(version)
            removed.append(version)
        if removed:
            log.info("weights.pruned", versions=removed, kept=versions[-self.keep:],
                     in_use=sorted(busy), transport="shared_memory")
        return removed

    def remove_after(self, version: int) -> list[int]:
        """Unlink the versions newer than `version` (a resumed trainer publishes its own)."""
        newer = [v for v in list_segments(self.run_dir, self.root) if v > version]
        for v in newer:
            self._unlink(v)
        return newer

    def _unlink(self, version: int) -> None:
        path = self.path(version)
        path.unlink(missing_ok=True)
        self._untrack(path.name)

    def close(self) -> None:
        """Unlink every segment of the run (explorers that mapped one keep their pages)."""
        for version in list_segments(self.run_dir, self.root):
            self._unlink(version)
        for name in list(self._mine):
            (self.root / name).unlink(missing_ok=True)
            self._untrack(name)


class SharedMemorySubscriber:
    """Maps weight versions from shared-memory segments (explorer side)."""

    def __init__(self, run_dir: str | Path, *, root: Path = SHM_ROOT):
        self.run_dir = Path(run_dir)
        self.root = Path(root)

    def path(self, version: int) -> Path:
        return segment_path(self.run_dir, version, self.root)

    def exists(self, version: int) -> bool:
        return self.path(version).exists()

    def versions(self) -> list[int]:
        return list_segments(self.run_dir, self.root)

    def load(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Map `version` read-only and check its header; the iterator yields views of it.

        The mapping (not the name) keeps the pages: retention may unlink the segment once this
        returns, and the views stay valid until the last of them is dropped.
        """
        path = self.path(version)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            have = self.versions()
            raise WeightsError(f"weights version {version} not found: no shared-memory segment "
                               f"{path} (versions in shared memory: {have or 'none'})") from None
        try:
            size = os.fstat(fd).st_size
            if size < 16:
                raise WeightsError(f"weights version {version}: segment {path} has {size} bytes, "
                                   "too few for a header")
            # not MAP_POPULATE: measured no faster for a read that touches each page once
            view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        header = self._header(version, path, view, size)
        return self._iterate(version, header, view)

    def _header(self, version: int, path: Path, view: mmap.mmap, size: int) -> SegmentHeader:
        if view[:8] != MAGIC:
            raise WeightsError(f"weights version {version}: {path} is not a tandem weights "
                               f"segment (magic {bytes(view[:8])!r})")
        length = int.from_bytes(view[8:16], "little")
        try:
            header = SegmentHeader.model_validate(json.loads(view[16:16 + length]))
        except (ValueError, ValidationError) as exc:
            raise WeightsError(f"weights version {version}: header of {path} is malformed: "
                               f"{str(exc).splitlines()[0]}") from None
        if header.format != FORMAT:
            raise WeightsError(f"{path}: format {header.format!r}, this reader knows {FORMAT!r}")
        if header.version != version or header.size != size:
            raise WeightsError(f"{path}: says version {header.version} of {header.size} bytes, "
                               f"asked for v{version}, has {size} bytes")
        for t in header.tensors:
            if t.offset + _nbytes(t.shape, torch_dtype(t.dtype)) > size:
                raise WeightsError(f"{path}: tensor {t.name!r} ends past the segment's "
                                   f"{size} bytes")
        return header

    def _iterate(self, version: int, header: SegmentHeader, view: mmap.mmap
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        with warnings.catch_warnings():
            # a read-only mapping: torch warns that its tensors are not writable, which is
            # the point (an engine copies them into its own parameters)
            warnings.simplefilter("ignore", UserWarning)
            for t in header.tensors:
                dtype = torch_dtype(t.dtype)
                numel = _nbytes(t.shape, dtype) // max(1, torch.empty((), dtype=dtype)
                                                       .element_size())
                if numel == 0:
                    yield t.name, torch.empty(t.shape, dtype=dtype)
                    continue
                yield t.name, torch.frombuffer(view, dtype=dtype, count=numel,
                                               offset=t.offset).view(t.shape)
        log.info("weights.loaded", version=version, method="checkpoint",
                 transport="shared_memory", seconds=round(time.perf_counter() - start, 3))
