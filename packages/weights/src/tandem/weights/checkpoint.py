"""Checkpoint method: weight versions as safetensors folders, written atomically, read by mmap.

Layout of one version, `run_dir/weights/v{N}/`:

    manifest.json                       version; each tensor's name/dtype/shape/shard; checksums
    shard-00000-of-00002.safetensors    tensors in the caller's order, split at `shard_bytes`

A version is written into `weights/.tmp-v{N}-<pid>-<rand>/`, each file and the folder fsynced,
then renamed to `v{N}` (one atomic rename) and only then announced: a reader either sees a whole
version or none. Retention deletes by renaming to `.trash-*` first for the same reason.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .tensors import WeightsError, check_unique_names, dtype_name, torch_dtype

log = structlog.get_logger(__name__)

FORMAT = "tandem.weights/1"
MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")


class ShardEntry(BaseModel):
    """One safetensors file of a version."""

    model_config = ConfigDict(extra="forbid")
    file: str
    bytes: int = Field(ge=0)
    xxh3_64: str = Field(description="hex xxh3-64 of the whole file")


class TensorEntry(BaseModel):
    """One tensor of a published version, as every transport's index names it."""

    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[int]


class ManifestTensor(TensorEntry):
    """One tensor of a version and the shard that holds it."""

    shard: int = Field(ge=0)


class Manifest(BaseModel):
    """`weights/v{N}/manifest.json`: what a version holds and how to check it."""

    model_config = ConfigDict(extra="forbid")
    format: str = FORMAT
    version: int = Field(ge=0)
    created_at: float
    tensors: list[ManifestTensor]
    shards: list[ShardEntry]


@dataclass(frozen=True)
class PublishedVersion:
    """What `WeightPublisher.publish` wrote."""

    version: int
    path: Path
    bytes: int
    tensors: int
    shards: int
    seconds: float


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def version_dir(run_dir: str | Path, version: int) -> Path:
    return weights_dir(run_dir) / f"v{version}"


def list_versions(run_dir: str | Path) -> list[int]:
    """Every complete version under `run_dir/weights`, oldest first."""
    root = weights_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _VERSION_DIR.match(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def _file_checksum(path: Path) -> str:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_64(view).hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plan_shards(tensors: list[tuple[str, torch.Tensor]], shard_bytes: int) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, t) in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _check_no_aliases(tensors: list[tuple[str, torch.Tensor]]) -> None:
    seen: dict[tuple[int, int], str] = {}
    for name, t in tensors:
        if t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            raise WeightsError(
                f"tensors {seen[key]!r} and {name!r} share memory (tied weights?); publish each "
                "weight once, e.g. from model.named_parameters(), which lists a tied weight once")
        seen[key] = name


class WeightPublisher:
    """Writes weight versions into `run_dir/weights` (trainer side).

    `announce(published)` is called after the rename, e.g. to send `WeightsPublished` to the
    master. `in_use` returns the versions some explorer is still loading or serving; retention
    never deletes those. `publish` blocks on disk IO: from asyncio, run it in a thread.
    """

    def __init__(self, run_dir: str | Path, *, keep: int = 3, shard_bytes: int = 2 * 2**30,
                 announce: Callable[[PublishedVersion], None] | None = None,
                 in_use: Callable[[], Collection[int]] | Collection[int] = ()):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (weights.keep_versions), got {keep}")
        self.root = weights_dir(run_dir)
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.shard_bytes = shard_bytes
        self.announce = announce
        self.in_use = in_use
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()

    @classmethod
    def from_config(cls, run_dir: str | Path, weights, **kwargs) -> WeightPublisher:
        """Build from a `WeightsConfig` section."""
        return cls(run_dir, keep=weights.keep_versions, shard_bytes=weights.shard_bytes, **kwargs)

    def _remove_leftovers(self) -> None:
        # A crash mid-publish or mid-delete leaves only dot-folders, never a half `v{N}`.
        for entry in self.root.iterdir():
            if entry.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(entry, ignore_errors=True)
                log.info("weights.leftover_removed", path=str(entry))

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                single_file: str | None = None, files: Mapping[str, bytes] | None = None
                ) -> PublishedVersion:
        """Write `version` atomically, announce it, then apply retention.

        `single_file` names the one shard that holds every tensor (a LoRA adapter version is
        `adapter_model.safetensors`, the name peft and vLLM read); `files` are written beside
        the shards (its `adapter_config.json`), inside the same atomic rename."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        final = self.root / f"v{version}"
        if final.exists():
            raise WeightsError(f"weights version {version} already exists at {final}; versions "
                               "are immutable, publish the next one")
        tensors = [(name, t.detach()) for name, t in named_tensors]
        if not tensors:
            raise WeightsError(f"weights version {version}: no tensors to publish")
        check_unique_names(tensors, f"weights version {version}")
        _check_no_aliases(tensors)
        tmp = self.root / f".tmp-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            plan = ([list(range(len(tensors)))] if single_file
                    else _plan_shards(tensors, self.shard_bytes))
            entries: list[ManifestTensor] = []
            shards: list[ShardEntry] = []
            total = 0
            for name, content in (files or {}).items():
                if name == MANIFEST or "/" in name or name == single_file:
                    raise WeightsError(f"weights version {version}: {name!r} is not a free "
                                       "file name beside the shards")
                (tmp / name).write_bytes(content)
                _fsync_path(tmp / name)
            for index, members in enumerate(plan):
                file = single_file or f"shard-{index:05d}-of-{len(plan):05d}.safetensors"
                chunk = {}
                for i in members:
                    name, t = tensors[i]
                    chunk[name] = t.to("cpu").contiguous()
                    entries.append(ManifestTensor(name=name, dtype=dtype_name(t.dtype),
                                                  shape=list(t.shape), shard=index))
                save_file(chunk, str(tmp / file), metadata={"tandem_version": str(version)})
                path = tmp / file
                _fsync_path(path)
                size = path.stat().st_size
                total += size
                shards.append(ShardEntry(file=file, bytes=size, xxh3_64=_file_checksum(path)))
            manifest = Manifest(version=version, created_at=time.time(), tensors=entries,
                                shards=shards)
            with open(tmp / MANIFEST, "w") as f:
                f.write(manifest.model_dump_json(indent=1))
                f.flush()
                os.fsync(f.fileno())
            _fsync_path(tmp)
            os.rename(tmp, final)
            _fsync_path(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        published = PublishedVersion(version=version, path=final, bytes=total,
                                     tensors=len(tensors), shards=len(plan),
                                     seconds=time.perf_counter() - start)
        log.info("weights.published", version=version, path=str(final), bytes=total,
                 shards=len(plan), seconds=round(published.seconds, 3))
        if self.announce is not None:
            self.announce(published)
        self.prune()
        return published

    def close(self) -> None:
        """Nothing to release: versions on disk outlive the trainer (a resume reads them)."""

    def prune(self) -> list[int]:
        """Delete versions older than the newest `keep` that no explorer uses; returns them."""
        versions = list_versions(self.run_dir)
        busy = set(self.in_use() if callable(self.in_use) else self.in_use)
        removed = []
        for version in versions[:-self.keep]:
            if version in busy:
                continue
            trash = self.root / f".trash-v{version}-{uuid.uuid4().hex[:8]}"
            os.rename(self.root / f"v{version}", trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(version)
        if removed:
            log.info("weights.pruned", versions=removed, kept=versions[-self.keep:],
                     in_use=sorted(busy))
        return removed


class WeightSubscriber:
    """Reads weight versions from `run_dir/weights` (explorer side)."""

    def __init__(self, run_dir: str | Path, *, verify: bool = True):
        self.run_dir = Path(run_dir)
        self.verify = verify

    @classmethod
    def from_config(cls, run_dir: str | Path, weights) -> WeightSubscriber:
        """Build from a `WeightsConfig` section (`verify_checksums`)."""
        return cls(run_dir, verify=weights.verify_checksums)

    def latest_version(self) -> int | None:
        """The newest complete version, or None when nothing has been published yet."""
        versions = list_versions(self.run_dir)
        return versions[-1] if versions else None

    def versions(self) -> list[int]:
        return list_versions(self.run_dir)

    def manifest(self, version: int) -> Manifest:
        """The checked manifest of `version`; a missing or malformed one is a WeightsError."""
        folder = version_dir(self.run_dir, version)
        path = folder / MANIFEST
        if not folder.is_dir():
            have = list_versions(self.run_dir)
            raise WeightsError(f"weights version {version} not found: no folder {folder} "
                               f"(published versions: {have or 'none'})")
        try:
            manifest = Manifest.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            raise WeightsError(f"weights version {version}: manifest {path} is missing") from None
        except ValidationError as exc:
            raise WeightsError(f"weights version {version}: manifest {path} is malformed: "
                               f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
        if manifest.format != FORMAT:
            raise WeightsError(f"{path}: format {manifest.format!r}, this reader knows {FORMAT!r}")
        if manifest.version != version:
            raise WeightsError(f"{path}: says version {manifest.version}, folder is v{version}")
        for t in manifest.tensors:
            if t.shard >= len(manifest.shards):
                raise WeightsError(f"{path}: tensor {t.name!r} names shard {t.shard}, "
                                   f"there are {len(manifest.shards)}")
        return manifest

    def check(self, version: int) -> Manifest:
        """Check every shard of `version` exists, has its size and (if `verify`) its checksum."""
        manifest = self.manifest(version)
        folder = version_dir(self.run_dir, version)
        for shard in manifest.shards:
            path = folder / shard.file
            if not path.is_file():
                raise WeightsError(f"weights version {version}: shard {path} is missing")
            size = path.stat().st_size
            if size != shard.bytes:
                raise WeightsError(f"weights version {version}: shard {path} has {size} bytes, "
                                   f"the manifest says {shard.bytes} (truncated or replaced)")
            if self.verify:
                digest = _file_checksum(path)
                if digest != shard.xxh3_64:
                    raise WeightsError(f"weights version {version}: shard {path} is corrupt "
                                       f"(xxh3 {digest}, manifest {shard.xxh3_64})")
        return manifest

    def load(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Check `version`, then yield its (name, tensor) in published order, memory-mapped.

        The check runs, and every shard is opened, before this returns: a bad version fails
        here, not half-way through the engine's `load_weights`, and a version that retention
        deletes afterwards stays readable through the open mappings until the iterator is done.
        """
        from safetensors import safe_open

        manifest = self.check(version)
        folder = version_dir(self.run_dir, version)
        handles = {}
        for index, shard in enumerate(manifest.shards):
            path = folder / shard.file
            try:
                handles[index] = (path, safe_open(str(path), framework="pt", device="cpu"))
            except Exception as exc:  # safetensors raises its own error types
                raise WeightsError(f"weights version {version}: shard {path} cannot be "
                                   f"opened as safetensors: {exc}") from None
        return self._iterate(version, manifest, handles)

    def _iterate(self, version: int, manifest: Manifest, handles: dict
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        for entry in manifest.tensors:
            path, f = handles[entry.shard]
            try:
                tensor = f.get_tensor(entry.name)
            except Exception as exc:  # safetensors raises its own error types
                raise WeightsError(f"weights version {version}: {path} has no readable "
                                   f"tensor {entry.name!r}: {exc}") from None
            if tensor.dtype != torch_dtype(entry.dtype) or list(tensor.shape) != entry.shape:
                raise WeightsError(
                    f"weights version {version}: {path}: tensor {entry.name!r} is "
                    f"{dtype_name(tensor.dtype)}{list(tensor.shape)}, the manifest says "
                    f"{entry.dtype}{entry.shape}")
            yield entry.name, tensor
        log.info("weights.loaded", version=version, method="checkpoint",
                 seconds=round(time.perf_counter() - start, 3))
