"""tandem-buffer as a real process: the CLI's address line and SIGTERM, and the crash test."""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from backstop import BACKSTOP
from buffer_helpers import make_group
from component_process import ComponentProcess
from tandem.common.errors import RequestFailed
from tandem.common.messages import GetBufferStats, PutExperiences, SampleGroups
from tandem.common.rpc import RpcClient


class BufferProcess(ComponentProcess):
    """`tandem-buffer` on a random port, started with `--set` overrides."""

    def __init__(self, run_dir, *overrides: str):
        args = ["--set", f"run_dir={run_dir}", "--address", "tcp://127.0.0.1:0"]
        for item in overrides:
            args += ["--set", item]
        super().__init__("tandem-buffer", [sys.executable, "-m", "tandem.buffer.cli", *args])
        self.address = self.wait_for("buffer.listening")["address"]


@pytest.fixture
def buffers():
    started: list[BufferProcess] = []

    def start(run_dir, *overrides):
        started.append(BufferProcess(run_dir, *overrides))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def test_cli_rejects_a_bad_config_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tandem.buffer.cli", "--set", f"run_dir={tmp_path}",
         "--set", "buffer.capacity=0", "--set", "buffer.priority=key"],
        capture_output=True, text=True, timeout=BACKSTOP)
    assert result.returncode == 2
    assert "buffer.capacity" in result.stderr and "Traceback" not in result.stderr


async def test_cli_serves_and_exits_cleanly_on_sigterm(tmp_path, buffers):
    process = buffers(tmp_path)
    client = RpcClient(process.address, peer="buffer", name="test")
    try:
        put = await client.call(PutExperiences(experiences=make_group("a", 2), group_size=2),
                                timeout=BACKSTOP, retries=0)
        assert put.stored == 2
    finally:
        await client.close()
    process.proc.send_signal(signal.SIGTERM)
    assert process.proc.wait(BACKSTOP) == 0
    process.wait_for("buffer.stopped")
    assert (tmp_path / "buffer.sqlite").exists() and (tmp_path / "logs" / "buffer.jsonl").exists()


async def test_crash_loses_no_acknowledged_put_and_leases_come_back(tmp_path, buffers):
    lease_seconds = 4.0
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    process = buffers(tmp_path)  # the default synchronous=full: every commit is fsynced
    client = RpcClient(process.address, peer="buffer", name="putter")
    acked: list[list] = []

    async def putter(worker: int) -> None:
        for i in range(10_000):
            group = make_group(f"w{worker}-{i}", 4, tokens=256, prompt_len=32)
            try:
                await client.call(PutExperiences(experiences=group, group_size=4),
                                  timeout=BACKSTOP, retries=0)
            except RequestFailed:
                continue  # refused: not acked, so not counted
            acked.append(group)

    putters = [asyncio.create_task(putter(w)) for w in range(4)]
    try:
        while len(acked) < 4:
            await asyncio.sleep(0.01)
        lease = await client.call(SampleGroups(num_groups=2, lease_seconds=lease_seconds),
                                  timeout=BACKSTOP, retries=0)
        # the kill lands after a number of acks the seed picks, with four puts on their way
        # (sent, being written, acked and unread): every interleaving must keep every ack
        kill_after = len(acked) + rng.randint(1, 40)
        while len(acked) < kill_after:
            await asyncio.sleep(0.005)
        process.proc.kill()
        process.proc.wait()
        for task in putters:  # the puts on their way when it died are never answered
            task.cancel()
        await asyncio.gather(*putters, return_exceptions=True)
    finally:
        await client.close()

    restarted = buffers(tmp_path)
    client = RpcClient(restarted.address, peer="buffer", name="checker")
    try:
        db = sqlite3.connect(tmp_path / "buffer.sqlite")
        counts = dict(db.execute("SELECT id, count(*) FROM experiences GROUP BY id"))
        for group in acked:
            for exp in group:
                assert counts.get(exp.id) == 1, f"{exp.id} lost or doubled (seed {seed})"
        states = dict(db.execute("SELECT group_id, state FROM groups"))
        db.close()
        if lease.expires_at - time.time() > 0.5:  # the restart took less than the lease
            assert {states[g] for g in lease.group_ids} == {"leased"}
        again = await client.call(PutExperiences(
            experiences=[e for group in acked for e in group], group_size=4), timeout=BACKSTOP,
            retries=0)
        assert again.stored == 0 and again.duplicates == 4 * len(acked)

        await asyncio.sleep(max(0.0, lease.expires_at - time.time()) + 0.1)
        stats = await client.call(GetBufferStats(), timeout=BACKSTOP, retries=0)
        assert stats.leases == 0
        everything = await client.call(
            SampleGroups(num_groups=stats.groups_ready), timeout=BACKSTOP, retries=0)
        assert set(lease.group_ids) <= set(everything.group_ids)
        assert {g[0].group_id for g in acked} <= set(everything.group_ids)
    finally:
        await client.close()
    restarted.proc.send_signal(signal.SIGTERM)
    assert restarted.proc.wait(BACKSTOP) == 0
