"""`weights.transport: fetch`: checkpoint versions for explorers that share no filesystem.

The trainer serves `run_dir/weights/v{N}/` with a `WeightServer` (tandem's own ZeroMQ RPC at
`weights.fetch_address`: the same sockets, codec, CurveZMQ keys and error replies as every other
component, and raw frames for the bytes, so a chunk is read once into a buffer and sent without
another copy). An explorer's `WeightFetcher` downloads the manifest, then each shard in chunks of
`weights.fetch_chunk_bytes` with `weights.fetch_window` requests in flight, appending them in
order to `weights/.partial-v{N}-<explorer>/`; every finished shard is checked against the
manifest's xxh3, then the folder is renamed to `v{N}` and loads exactly as a shared-filesystem
version does.

A cut connection costs only the chunks in flight: the partial folder keeps every byte written,
so the next attempt (in the same call, or after the explorer restarts) resumes at the end of
what is on disk. The whole fetch is bounded by `sync.timeout`, and its error names the trainer's
address and what was still missing.

Many explorers, one trainer: the server admits at most `weights.fetch_streams` explorers at a
time (the others are answered `busy` and retry shortly), each with at most `fetch_window` chunks
requested, so what the trainer has in flight for uploads is bounded by
`fetch_streams x fetch_window x fetch_chunk_bytes` whatever the number of explorers, and each
admitted explorer gets a full share of the link instead of N explorers slowing each other
equally. Explorers do not relay to each other: with the few to tens of explorers a run has, the
trainer's link carries N copies per version, and in exchange no explorer's download depends on
another explorer staying up.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import numpy as np
import structlog
import xxhash

from tandem.common.errors import PeerDead, RequestFailed, WaitTimeout
from tandem.common.messages.weights import (
    FetchChunk,
    FetchChunkReply,
    FetchManifest,
    FetchManifestReply,
)
from tandem.common.rpc import CallContext, RpcClient, RpcServer

from .checkpoint import MANIFEST, Manifest, list_versions, version_dir, weights_dir
from .tensors import WeightsError

log = structlog.get_logger(__name__)

IDLE_SECONDS = 2.0  # an explorer that went quiet mid-version (died) gives its place up


class WeightServer:
    """Serves the trainer's published versions to fetching explorers (trainer rank 0)."""

    def __init__(self, run_dir: str | Path, address: str, *, transport=None, streams: int = 8,
                 max_chunk_bytes: int = 2**30):
        self.run_dir = Path(run_dir)
        self.streams = streams
        self.max_chunk_bytes = max_chunk_bytes
        # no reply cache: a chunk is cheap to read again and must not stay in memory
        self.server = RpcServer(address, name="weights", transport=transport, reply_cache=0)
        self.server.register(FetchManifest, self._on_manifest)
        self.server.register(FetchChunk, self._on_chunk)
        self._admitted: dict[str, float] = {}  # peer -> last request or reply (monotonic)
        self._inflight: dict[str, int] = {}  # peer -> chunk requests being read
        self._serving: dict[int, float] = {}  # version -> last request (monotonic)
        self._manifests: dict[int, tuple[Manifest, str]] = {}
        self.bytes_sent = 0
        self.peak_admitted = 0

    @classmethod
    def from_config(cls, config) -> WeightServer:
        w = config.weights
        return cls(config.run_dir, w.fetch_address, transport=config.transport,
                   streams=w.fetch_streams, max_chunk_bytes=w.fetch_chunk_bytes)

    async def start(self) -> str:
        bound = await self.server.start()
        log.info("weights.server_started", address=bound, streams=self.streams)
        return bound

    async def close(self) -> None:
        await self.server.close()
        log.info("weights.server_stopped", bytes_sent=self.bytes_sent)

    def serving(self) -> list[int]:
        """Versions some explorer asked for within the last few seconds: retention keeps them."""
        now = time.monotonic()
        return [v for v, at in self._serving.items() if now - at < 10.0]

    def _manifest(self, version: int) -> tuple[Manifest, str]:
        cached = self._manifests.get(version)
        path = version_dir(self.run_dir, version) / MANIFEST
        if cached is None or not path.exists():
            try:
                text = path.read_text()
            except FileNotFoundError:
                self._manifests.pop(version, None)
                raise RequestFailed("not_found", f"weights version {version} is not on the "
                                    f"trainer (has {list_versions(self.run_dir) or 'none'})")
            cached = (Manifest.model_validate_json(text), text)
            self._manifests = {v: m for v, m in self._manifests.items() if v > version - 8}
            self._manifests[version] = cached
        self._serving[version] = time.monotonic()
        return cached

    async def _on_manifest(self, msg: FetchManifest, ctx: CallContext) -> FetchManifestReply:
        # byte for byte, so the explorer's copy of the version is the trainer's
        return FetchManifestReply(version=msg.version, manifest=self._manifest(msg.version)[1])

    def _admit(self, peer: str) -> None:
        now = time.monotonic()
        if peer not in self._admitted and len(self._admitted) >= self.streams:
            for other, at in list(self._admitted.items()):
                if not self._inflight.get(other) and now - at > IDLE_SECONDS:
                    del self._admitted[other]
            if len(self._admitted) >= self.streams:
                raise RequestFailed("busy", f"the weight server already serves {self.streams} "
                                    "explorers (weights.fetch_streams)", retry_after=0.05)
        self._admitted[peer] = now
        self.peak_admitted = max(self.peak_admitted, len(self._admitted))

    async def _on_chunk(self, msg: FetchChunk, ctx: CallContext) -> FetchChunkReply:
        manifest = self._manifest(msg.version)[0]
        shard = next((s for s in manifest.shards if s.file == msg.file), None)
        if shard is None:  # only files the manifest names: never a path a peer makes up
            raise RequestFailed("bad_request", f"weights version {msg.version} has no shard "
                                f"{msg.file!r}")
        if msg.length > self.max_chunk_bytes or msg.offset + msg.length > shard.bytes:
            raise RequestFailed("bad_request", f"{msg.file}: bytes {msg.offset}+{msg.length} "
                                f"outside 0..{shard.bytes} or over {self.max_chunk_bytes} a "
                                "request")
        self._admit(ctx.peer)
        self._inflight[ctx.peer] = self._inflight.get(ctx.peer, 0) + 1
        path = version_dir(self.run_dir, msg.version) / msg.file
        try:
            data = await asyncio.to_thread(_read_range, path, msg.offset, msg.length)
        except FileNotFoundError:
            raise RequestFailed("not_found", f"weights version {msg.version} was removed from "
                                "the trainer while being fetched") from None
        finally:
            self._inflight[ctx.peer] -= 1
            self._admitted[ctx.peer] = time.monotonic()
            if msg.last and not self._inflight[ctx.peer]:
                del self._admitted[ctx.peer]
        self.bytes_sent += msg.length
        return FetchChunkReply(data=data)


def _read_range(path: Path, offset: int, length: int) -> np.ndarray:
    out = np.empty(length, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        view = memoryview(out)
        got = 0
        while got < length:
            n = f.readinto(view[got:])
            if not n:
                raise FileNotFoundError(f"{path} ended at {offset + got}, expected {offset + length}")
            got += n
    return out


class WeightFetcher:
    """Downloads versions from the trainer's `WeightServer` into this explorer's run_dir."""

    def __init__(self, run_dir: str | Path, address: str, *, transport=None,
                 chunk_bytes: int = 8 * 2**20, window: int = 4, timeout: float = 600.0,
                 keep: int = 3, client_name: str = "fetcher"):
        self.run_dir = Path(run_dir)
        self.address = address
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.timeout = timeout
        self.keep = keep
        self.client_name = client_name
        self._client: RpcClient | None = None
        self.bytes_fetched = 0

    @classmethod
    def from_config(cls, config, name: str) -> WeightFetcher:
        w = config.weights
        return cls(config.run_dir, w.fetch_address, transport=config.transport,
                   chunk_bytes=w.fetch_chunk_bytes, window=w.fetch_window,
                   timeout=config.sync.timeout, keep=w.keep_versions, client_name=name)

    def _rpc(self) -> RpcClient:
        if self._client is None:
            self._client = RpcClient(self.address, peer="trainer weight server",
                                     transport=self.transport, name=self.client_name)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def fetch(self, version: int) -> Path:
        """Make `weights/v{version}` complete in the local run_dir; returns its folder."""
        final = version_dir(self.run_dir, version)
        if (final / MANIFEST).is_file():
            return final
        start = time.monotonic()
        deadline = start + self.timeout
        # one partial folder per explorer: two explorers sharing a run_dir never write one file
        partial = weights_dir(self.run_dir) / f".partial-v{version}-{self.client_name}"
        partial.mkdir(parents=True, exist_ok=True)
        last_error: Exception | None = None
        ended: Exception | None = None  # what ran into the deadline, after `last_error`
        fetched_before = self.bytes_fetched
        while True:
            try:
                await self._fetch_once(version, partial, deadline)
                break
            except (PeerDead, ConnectionError, RequestFailed) as exc:
                if isinstance(exc, RequestFailed) and exc.code not in ("busy", "internal"):
                    raise WeightsError(f"weights version {version}: the trainer's weight server "
                                       f"at {self.address} refused: {exc.message}") from None
                # an error that only says sync.timeout ran out (a request cut short or never
                # sent) does not hide the one before it, which says why: both are reported
                past = time.monotonic() >= deadline
                if last_error is None or not past:
                    last_error = exc
                else:
                    ended = exc
                if past:
                    break
                # a new connection, then resume at the end of what is on disk
                await self.close()
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
        if not (partial / MANIFEST).is_file():
            have = sum(p.stat().st_size for p in partial.glob("*.safetensors"))
            raise WaitTimeout(
                f"weights version {version}: fetching from the trainer's weight server at "
                f"{self.address} did not finish within {self.timeout:g}s (sync.timeout); "
                f"{have} bytes on disk in {partial}, last error: {_describe(last_error)}"
                + (f"; then {_describe(ended)}" if ended is not None else ""))
        try:
            os.rename(partial, final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another explorer here was first
        _fsync_dir(final.parent)
        seconds = time.monotonic() - start
        log.info("weights.fetched", version=version, address=self.address,
                 bytes=self.bytes_fetched - fetched_before, seconds=round(seconds, 3))
        self._prune(version)
        return final

    async def _fetch_once(self, version: int, partial: Path, deadline: float) -> None:
        reply = await self._call(FetchManifest(version=version), deadline)
        assert isinstance(reply, FetchManifestReply)
        manifest = Manifest.model_validate_json(reply.manifest)
        if manifest.version != version:
            raise WeightsError(f"the weight server at {self.address} answered version "
                               f"{manifest.version} for version {version}")
        for index, shard in enumerate(manifest.shards):
            path = partial / shard.file
            if path.name != shard.file or shard.file in (MANIFEST, "") or "/" in shard.file:
                raise WeightsError(f"weights version {version}: the manifest from "
                                   f"{self.address} names a bad shard file {shard.file!r}")
            done = path.with_name(path.name + ".ok")
            if done.exists():
                continue
            digest = await self._fetch_shard(version, shard.file, shard.bytes, path, deadline,
                                             last=index == len(manifest.shards) - 1)
            if digest != shard.xxh3_64:
                path.unlink()  # the next attempt fetches it whole
                raise RequestFailed("internal", f"shard {shard.file} of version {version} "
                                    f"arrived corrupt (xxh3 {digest}, manifest "
                                    f"{shard.xxh3_64})")
            done.touch()
        for marker in partial.glob("*.ok"):
            marker.unlink()
        await asyncio.to_thread(_write_synced, partial / MANIFEST, reply.manifest)

    async def _fetch_shard(self, version: int, file: str, size: int, path: Path,
                           deadline: float, *, last: bool) -> str:
        """Append the shard's missing chunks to `path`; returns the xxh3 of the whole file,
        hashed as the chunks arrive (no second pass over the bytes)."""
        # resume at the last whole chunk on disk (chunks are appended in order)
        have = path.stat().st_size if path.exists() else 0
        offset = min(have - have % self.chunk_bytes, size)
        digest = xxhash.xxh3_64()
        if offset:
            await asyncio.to_thread(_hash_prefix, digest, path, offset)
        with await asyncio.to_thread(open, path, "ab" if offset else "wb") as f:
            f.truncate(offset)
            f.seek(offset)
            pending: list[asyncio.Task] = []
            next_offset = offset
            try:
                while next_offset < size or pending:
                    while next_offset < size and len(pending) < self.window:
                        length = min(self.chunk_bytes, size - next_offset)
                        pending.append(asyncio.ensure_future(self._call(FetchChunk(
                            version=version, file=file, offset=next_offset, length=length,
                            last=last and next_offset + length == size), deadline)))
                        next_offset += length
                    reply = await pending.pop(0)
                    assert isinstance(reply, FetchChunkReply)
                    await asyncio.to_thread(_append, f, digest, memoryview(reply.data))
                    self.bytes_fetched += reply.data.nbytes
                f.flush()
                os.fsync(f.fileno())
                return digest.hexdigest()
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                f.flush()

    async def _call(self, msg, deadline: float):
        refused: RequestFailed | None = None  # the server's last `busy`, for the error past time
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _OutOfTime(msg.TYPE, refused)
            timeout = min(remaining, self.transport.rpc_timeout if self.transport else 30.0)
            try:
                return await self._rpc().call(msg, timeout=timeout, retries=0,
                                              timeout_key="sync.timeout")
            except PeerDead as exc:
                if refused is not None and time.monotonic() >= deadline:
                    # a call cut short by the deadline after busy answers: busy says why
                    raise _OutOfTime(msg.TYPE, refused) from exc
                raise
            except RequestFailed as exc:
                if exc.code != "busy":
                    raise
                refused = exc
                await asyncio.sleep(min(exc.retry_after or 0.05, max(0.0, remaining)))

    def _prune(self, newest: int) -> None:
        for version in list_versions(self.run_dir)[:-self.keep]:
            if version < newest:
                shutil.rmtree(version_dir(self.run_dir, version), ignore_errors=True)


class _OutOfTime(PeerDead):
    """sync.timeout ran out before a request could be sent; `refused` is the server's last
    `busy` answer while it was retried, if any."""

    def __init__(self, request: str, refused: RequestFailed | None):
        detail = f"; it last answered {refused.code}: {refused.message}" if refused else ""
        super().__init__("trainer weight server", f"no time left for {request}{detail}")
        self.refused = refused


def _describe(exc: Exception | None) -> str:
    if exc is None:
        return "none (out of time)"
    if isinstance(exc, _OutOfTime):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _append(f, digest, data: memoryview) -> None:
    f.write(data)
    digest.update(data)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _hash_prefix(digest, path: Path, length: int) -> None:
    with open(path, "rb", buffering=0) as f:
        while length > 0 and (chunk := f.read(min(16 * 2**20, length))):
            digest.update(chunk)
            length -= len(chunk)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
