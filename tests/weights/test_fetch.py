"""weights.transport: fetch — a real WeightServer on a TCP port, real WeightFetchers writing
into their own run dirs: bytes and tensors arrive intact, a cut connection resumes where it
stopped, a corrupt shard or a silent trainer ends within sync.timeout naming the trainer's
address, and the server admits at most `fetch_streams` explorers at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from backstop import BACKSTOP

from tandem.common.config import TransportConfig
from tandem.common.errors import RequestFailed, WaitTimeout
from tandem.common.messages.weights import FetchChunk
from tandem.common.rpc import RpcClient
from tandem.weights import WeightPublisher, WeightSubscriber, WeightsError, version_dir
from tandem.weights.fetch import WeightFetcher, WeightServer

CHUNK = 64 * 1024
TRANSPORT = TransportConfig(rpc_timeout=BACKSTOP)


def tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(128, 256, generator=g)) for i in range(6)]


@pytest.fixture
def published(tmp_path):
    """Trainer run dir with versions 1 and 2, three shards each (~128 KiB a tensor)."""
    trainer = tmp_path / "trainer"
    pub = WeightPublisher(trainer, shard_bytes=2**18)
    for v in (1, 2):
        pub.publish(v, tensors(v))
    return trainer


async def serve(run_dir, **kwargs) -> WeightServer:
    server = WeightServer(run_dir, "tcp://127.0.0.1:0", transport=TRANSPORT, **kwargs)
    await server.start()
    return server


def fetcher(run_dir, address, **kwargs) -> WeightFetcher:
    opts = dict(transport=TRANSPORT, chunk_bytes=CHUNK, window=4, timeout=BACKSTOP)
    return WeightFetcher(run_dir, address, **(opts | kwargs))


def corrupt_a_shard(run_dir) -> None:
    """Flip a byte of version 1's first shard: its xxh3 no longer matches the manifest."""
    shard = min(version_dir(run_dir, 1).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


def shard_bytes(run_dir, version) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(version_dir(run_dir, version).iterdir())}


async def test_a_version_arrives_byte_for_byte_and_loads(published, tmp_path):
    server = await serve(published)
    f = fetcher(tmp_path / "explorer", server.server.bound)
    try:
        path = await f.fetch(2)
    finally:
        await f.close()
        await server.close()
    assert path == version_dir(tmp_path / "explorer", 2)
    assert shard_bytes(tmp_path / "explorer", 2) == shard_bytes(published, 2)
    loaded = dict(WeightSubscriber(tmp_path / "explorer").load(2))
    for name, t in tensors(2):
        assert torch.equal(loaded[name], t)
    assert not list((tmp_path / "explorer" / "weights").glob(".partial-*"))
    assert f.bytes_fetched == server.bytes_sent == sum(
        len(b) for n, b in shard_bytes(published, 2).items() if n.endswith(".safetensors"))


async def test_a_fetched_version_is_not_fetched_again(published, tmp_path):
    server = await serve(published)
    f = fetcher(tmp_path / "explorer", server.server.bound)
    try:
        await f.fetch(1)
        first = f.bytes_fetched
        await f.fetch(1)
    finally:
        await f.close()
        await server.close()
    assert f.bytes_fetched == first > 0


async def test_resumes_after_a_restart_from_the_bytes_on_disk(published, tmp_path):
    # an explorer killed mid-fetch left half of shard 0 (and a torn chunk) in its partial folder
    explorer = tmp_path / "explorer"
    partial = explorer / "weights" / ".partial-v2-fetcher"
    partial.mkdir(parents=True)
    shards = {n: b for n, b in shard_bytes(published, 2).items() if n.endswith(".safetensors")}
    first = min(shards)
    kept = 2 * CHUNK
    (partial / first).write_bytes(shards[first][:kept + 1000])
    server = await serve(published)
    f = fetcher(explorer, server.server.bound)
    try:
        await f.fetch(2)
    finally:
        await f.close()
        await server.close()
    assert shard_bytes(explorer, 2) == shard_bytes(published, 2)
    assert f.bytes_fetched == sum(map(len, shards.values())) - kept


class CuttingProxy:
    """TCP relay to the server that cuts its first connection after `cut_after` bytes."""

    def __init__(self, target: str, cut_after: int):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.cut_after = cut_after
        self.connections = 0
        self.downstream = 0
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _client(self, reader, writer):
        self.connections += 1
        cut = self.cut_after if self.connections == 1 else None
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(src, dst, count: bool):
            try:
                while data := await src.read(65536):
                    if count:
                        self.downstream += len(data)
                        if cut is not None and self.downstream > cut:
                            break
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                for w in (writer, up_writer):
                    w.transport.abort()

        task = asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))
        self.tasks.add(task)
        await task

    async def close(self):
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_a_cut_connection_resumes_instead_of_starting_over(published, tmp_path):
    server = await serve(published)
    size = sum(len(b) for n, b in shard_bytes(published, 2).items() if n.endswith(".safetensors"))
    proxy = CuttingProxy(server.server.bound, cut_after=size // 2)
    address = await proxy.start()
    # the requests in flight when the connection is cut get no reply: rpc_timeout runs out on
    # them (the replies that do come are a chunk's read in this process)
    f = fetcher(tmp_path / "explorer", address, transport=TransportConfig(rpc_timeout=5.0))
    try:
        await f.fetch(2)
    finally:
        await f.close()
        await proxy.close()
        await server.close()
    assert proxy.connections >= 2  # the connection was cut and made again
    assert shard_bytes(tmp_path / "explorer", 2) == shard_bytes(published, 2)
    # what was written before the cut is not fetched again: at most the window is repeated
    assert server.bytes_sent < size + 4 * CHUNK + size // 2


async def test_a_corrupt_shard_fails_within_the_timeout_naming_the_trainer(published, tmp_path):
    corrupt_a_shard(published)
    server = await serve(published)
    f = fetcher(tmp_path / "explorer", server.server.bound, timeout=1.5)
    try:
        with pytest.raises(WaitTimeout) as err:
            await f.fetch(1)
    finally:
        await f.close()
        await server.close()
    message = str(err.value)
    assert server.server.bound in message and "sync.timeout" in message
    assert "corrupt" in message
    assert not version_dir(tmp_path / "explorer", 1).exists()


async def test_running_out_of_time_keeps_the_error_that_says_why(published, tmp_path):
    # the first attempt finds a corrupt shard; the trainer then stops answering and the second
    # attempt runs into sync.timeout: the error names both, not only the time that ran out
    corrupt_a_shard(published)
    server = await serve(published)
    f = fetcher(tmp_path / "explorer", server.server.bound, timeout=2.0)
    attempt = f._fetch_once

    async def then_the_trainer_goes_quiet(*args):
        try:
            await attempt(*args)
        finally:
            await server.close()

    f._fetch_once = then_the_trainer_goes_quiet
    try:
        with pytest.raises(WaitTimeout) as err:
            await f.fetch(1)
    finally:
        await f.close()
        await server.close()
    message = str(err.value)
    assert "arrived corrupt" in message and "then PeerDead" in message, message


async def test_a_server_busy_until_the_timeout_says_so(published, tmp_path, monkeypatch):
    # another explorer holds the one stream (weights.fetch_streams: 1) for longer than
    # sync.timeout: the error says the server was busy and which setting limits it
    monkeypatch.setattr("tandem.weights.fetch.IDLE_SECONDS", BACKSTOP)
    server = await serve(published, streams=1)
    holder = RpcClient(server.server.bound, peer="weights", transport=TRANSPORT)
    f = fetcher(tmp_path / "explorer", server.server.bound, timeout=1.0)
    try:
        await holder.call(FetchChunk(version=1, file=_first_shard(published), offset=0,
                                     length=CHUNK))
        with pytest.raises(WaitTimeout) as err:
            await f.fetch(1)
    finally:
        await f.close()
        await holder.close()
        await server.close()
    message = str(err.value)
    assert "busy" in message and "weights.fetch_streams" in message, message


async def test_a_silent_trainer_fails_within_the_timeout(tmp_path):
    f = fetcher(tmp_path / "explorer", "tcp://127.0.0.1:9", timeout=1.0)
    try:
        with pytest.raises(WaitTimeout) as err:
            await f.fetch(3)
    finally:
        await f.close()
    assert "tcp://127.0.0.1:9" in str(err.value) and "PeerDead" in str(err.value)


async def test_a_version_the_trainer_lacks_fails_at_once(published, tmp_path):
    server = await serve(published)
    f = fetcher(tmp_path / "explorer", server.server.bound)
    try:
        with pytest.raises(WeightsError, match="not on the trainer"):
            await f.fetch(7)
    finally:
        await f.close()
        await server.close()


async def test_requests_outside_the_manifest_are_refused(published, tmp_path):
    (published / "secret.txt").write_text("x")
    server = await serve(published)
    client = RpcClient(server.server.bound, peer="weights", transport=TRANSPORT)
    try:
        for file, offset, length in (("../secret.txt", 0, 1), ("manifest.json", 0, 1),
                                     (_first_shard(published), 2**30, 10),
                                     (_first_shard(published), 0, 2**31)):
            with pytest.raises(RequestFailed) as err:
                await client.call(FetchChunk(version=1, file=file, offset=offset,
                                             length=length))
            assert err.value.code == "bad_request"
    finally:
        await client.close()
        await server.close()


def _first_shard(run_dir) -> str:
    return min(version_dir(run_dir, 1).glob("*.safetensors")).name


async def test_the_server_admits_at_most_fetch_streams_explorers(published, tmp_path):
    server = await serve(published, streams=1)
    fetchers = [fetcher(tmp_path / f"explorer-{i}", server.server.bound, client_name=f"e{i}")
                for i in range(3)]
    try:
        await asyncio.gather(*(f.fetch(2) for f in fetchers))
    finally:
        for f in fetchers:
            await f.close()
        await server.close()
    assert server.peak_admitted == 1
    for i in range(3):
        assert shard_bytes(tmp_path / f"explorer-{i}", 2) == shard_bytes(published, 2)


async def test_two_explorers_sharing_a_run_dir_fetch_one_version(published, tmp_path):
    server = await serve(published)
    shared = tmp_path / "host"
    fetchers = [fetcher(shared, server.server.bound, client_name=f"explorer-{i}")
                for i in range(2)]
    try:
        paths = await asyncio.gather(*(f.fetch(1) for f in fetchers))
    finally:
        for f in fetchers:
            await f.close()
        await server.close()
    assert paths[0] == paths[1] == version_dir(shared, 1)
    assert shard_bytes(shared, 1) == shard_bytes(published, 1)
    assert not list((shared / "weights").glob(".partial-*"))


def test_fetch_settings_are_checked():
    from tandem.common.config import load_config
    from tandem.common.errors import ConfigError

    with pytest.raises(ConfigError, match="weights.fetch_address"):
        load_config(None, ["weights.fetch_address=trainer:5580"])
    with pytest.raises(ConfigError, match="weights.transport"):
        load_config(None, ["weights.transport=nfs"])
    assert np.dtype("uint8")  # the chunk frames are raw bytes
