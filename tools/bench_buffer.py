"""Benchmark the buffer: durable put throughput and sample+ack latency, side by side.

1. Put throughput of 1k-token experiences in batches of 64 (16 groups of 4), through a
   `tandem-buffer` process from this process, with 1 and with 4 puts in flight, against raw
   batched sqlite inserts of the same rows (same schema and pragmas, one commit per batch,
   rows serialised beforehand) and against the embedded `SqliteStore` without RPC, all in
   the same run, interleaved, on fresh files, with synchronous=full (every put fsynced).
2. Sample+ack round trips (8 groups of 4 per sample) against a `tandem-buffer` process whose
   store holds `--stored` experiences (prefilled through the embedded store), and the same
   calls on the embedded store just before, to tell the store's share from RPC and scheduling.

    .venv/bin/python tools/bench_buffer.py [--out .bench/buffer.json] [--stored 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tandem.buffer import SqliteStore
from tandem.buffer.rows import to_row
from tandem.buffer.schema import SCHEMA
from tandem.common.messages import (
    AckLease, Experience, GetBufferStats, PutExperiences, SampleGroups, experience_id, group_id,
)
from tandem.common.rpc import RpcClient

GROUP = 4


def experiences(prefix: str, count: int, tokens: int, seed: int = 0) -> list[Experience]:
    """`count` experiences of `tokens` tokens (a quarter prompt), in groups of GROUP."""
    rng = np.random.default_rng(seed)
    prompt = tokens // 4
    out = []
    for i in range(count):
        task, index = f"{prefix}-{i // GROUP}", i % GROUP
        out.append(Experience(
            id=experience_id(task, index, 0, "bench"), task_id=task, group_id=group_id(task, 0),
            tokens=rng.integers(0, 150_000, tokens, dtype=np.int32), prompt_len=prompt,
            action_mask=np.ones(tokens - prompt, dtype=np.uint8),
            logprobs=rng.standard_normal(tokens - prompt).astype(np.float32),
            reward=float(index % 2), policy_version=0, explorer="bench"))
    return out


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class BufferProcess:
    """A `tandem-buffer` process on a random port (its JSON log lines drained by a thread)."""

    def __init__(self, run_dir: Path, *overrides: str):
        args = ["--set", f"run_dir={run_dir}", "--address", "tcp://127.0.0.1:0",
                "--set", "logging.trace=false"]
        for item in overrides:
            args += ["--set", item]
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.buffer.cli", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stderr],
                         daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == "buffer.listening":
                self.address = record["address"]
                return

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RawSqlite:
    """The baseline: the same rows into the same table, one fsynced commit per batch."""

    def __init__(self, path: Path):
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(SCHEMA)

    async def run(self, work: list[list[tuple]]) -> float:
        started = time.perf_counter()
        for batch in work:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT INTO experiences (id, group_id, meta, tokens, action_mask, logprobs, "
                "nbytes) VALUES (?, ?, ?, ?, ?, ?, ?)", batch)
            self.conn.execute("COMMIT")
        return time.perf_counter() - started

    async def close(self) -> None:
        self.conn.close()


class Embedded:
    """The store without RPC, in this process."""

    def __init__(self, path: Path):
        self.store = SqliteStore(path)

    async def run(self, work: list[list[Experience]]) -> float:
        started = time.perf_counter()
        for batch in work:
            await self.store.put(batch, [GROUP] * len(batch))
        return time.perf_counter() - started

    async def close(self) -> None:
        await self.store.close()


class Service:
    """Puts through a tandem-buffer process, `inflight` at a time."""

    def __init__(self, root: Path, inflight: int):
        self.process = BufferProcess(root)
        self.client = RpcClient(self.process.address, peer="buffer", name="bench")
        self.inflight = inflight

    async def run(self, work: list[list[Experience]]) -> float:
        await self.client.call(GetBufferStats(), timeout=30, retries=0)  # connected first
        pending = iter(work)

        async def sender() -> None:
            for batch in pending:
                reply = await self.client.call(
                    PutExperiences(experiences=batch, group_size=GROUP), timeout=60, retries=0,
                    timeout_key="bench")
                assert reply.stored == len(batch), reply

        started = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(self.inflight)))
        return time.perf_counter() - started

    async def close(self) -> None:
        await self.client.close()
        self.process.stop()


async def put_throughput(root: Path, args) -> dict:
    """Each path gets `repeat` rounds of `batches` puts, rounds interleaved across paths (in a
    rotating order) so that a disk busy for a while slows all of them alike; experiences/s of
    every round, per path."""
    paths = {
        "raw sqlite (batched inserts)": RawSqlite(root / "raw.sqlite"),
        "service, 1 put in flight": Service(root / "service1", 1),
        "service, 4 puts in flight": Service(root / "service4", 4),
        "embedded SqliteStore (no RPC)": Embedded(root / "embedded.sqlite"),
    }
    names = list(paths)
    rates: dict[str, list[float]] = {name: [] for name in names}
    count = args.batches * args.batch
    try:
        for rep in range(args.repeat):
            for k in range(len(names)):
                name = names[(rep + k) % len(names)]
                items = experiences(f"r{rep}p{k}", count, args.tokens, seed=rep)
                work = batches(items, args.batch)
                if isinstance(paths[name], RawSqlite):
                    work = [[to_row(e) for e in batch] for batch in work]
                rates[name].append(count / await paths[name].run(work))
    finally:
        for path in paths.values():
            await path.close()
    return rates


async def sample_latency(root: Path, args) -> dict:
    run_dir = root / "sample"
    store = SqliteStore(run_dir / "buffer.sqlite", synchronous="normal", capacity=10**7)
    template = experiences("fill", GROUP, args.sample_tokens)
    started = time.perf_counter()
    chunk = 1024
    # both measurements consume what they sample: fill so that the last one ends at --stored
    fill = args.stored + 2 * (args.samples + 10) * args.groups * GROUP
    for first in range(0, fill, chunk):
        batch = []
        for i in range(first, min(first + chunk, fill)):
            task = f"fill-{i // GROUP}"
            batch.append(template[i % GROUP].model_copy(update=dict(
                id=experience_id(task, i % GROUP, i // 10_000, "bench"), task_id=task,
                group_id=group_id(task, i // 10_000), policy_version=i // 10_000)))
        await store.put(batch, [GROUP] * len(batch))
    fill_seconds = time.perf_counter() - started
    # the same calls on the embedded store, to tell the store's share from RPC and scheduling
    timings: dict[str, list[float]] = {"store sample": [], "store ack": []}
    for i in range(args.samples + 10):
        t0 = time.perf_counter()
        lease = await store.sample(args.groups, policy=args.policy)
        t1 = time.perf_counter()
        await store.ack(lease.lease_id)
        t2 = time.perf_counter()
        if i >= 10:
            timings["store sample"].append(t1 - t0)
            timings["store ack"].append(t2 - t1)
    await store.close()

    process = BufferProcess(run_dir)
    client = RpcClient(process.address, peer="buffer", name="bench")
    timings.update({"sample": [], "ack": [], "sample+ack": []})
    try:
        before = await client.call(GetBufferStats(), timeout=60, retries=0)
        for i in range(args.samples + 10):
            t0 = time.perf_counter()
            lease = await client.call(SampleGroups(num_groups=args.groups, policy=args.policy),
                                      timeout=30, retries=0)
            t1 = time.perf_counter()
            await client.call(AckLease(lease_id=lease.lease_id), timeout=30, retries=0)
            t2 = time.perf_counter()
            if i >= 10:  # warm-up
                timings["sample"].append(t1 - t0)
                timings["ack"].append(t2 - t1)
                timings["sample+ack"].append(t2 - t0)
        after = await client.call(GetBufferStats(), timeout=60, retries=0)
    finally:
        await client.close()
        process.stop()

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(np.array(values) * 1e3, q))

    return {
        "fill_seconds": fill_seconds,
        "stored_before": sum(before.by_state[s] for s in ("ready", "leased", "waiting")),
        "stored_after": sum(after.by_state[s] for s in ("ready", "leased", "waiting")),
        "latency_ms": {name: {"p50": pct(v, 50), "p99": pct(v, 99),
                              "mean": statistics.fmean(v) * 1e3} for name, v in timings.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".bench/buffer.json")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per experience (puts)")
    parser.add_argument("--batch", type=int, default=64, help="experiences per put")
    parser.add_argument("--batches", type=int, default=8, help="puts per path per round")
    parser.add_argument("--repeat", type=int, default=10,
                        help="interleaved rounds; the median round is reported")
    parser.add_argument("--stored", type=int, default=100_000,
                        help="experiences stored while sampling")
    parser.add_argument("--sample-tokens", type=int, default=1024,
                        help="tokens per stored experience")
    parser.add_argument("--samples", type=int, default=300, help="sample+ack round trips timed")
    parser.add_argument("--groups", type=int, default=8, help="groups per sample")
    parser.add_argument("--policy", default="fifo", choices=["fifo", "newest", "priority"])
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-buffer-", dir=os.environ.get("BENCH_TMP")))
    try:
        puts = asyncio.run(put_throughput(root, args))
        sampling = asyncio.run(sample_latency(root, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    median = {name: statistics.median(rates) for name, rates in puts.items()}
    raw = median["raw sqlite (batched inserts)"]
    print(f"\nput throughput: {args.repeat} interleaved rounds of {args.batches} puts of "
          f"{args.batch} x {args.tokens}-token experiences per path, synchronous=full")
    print(f"{'path':32} {'median exp/s':>12} {'vs raw':>7} {'rounds min..max':>17}")
    for name, rate in median.items():
        print(f"{name:32} {rate:12.0f} {rate / raw:7.0%} "
              f"{min(puts[name]):8.0f}..{max(puts[name]):<8.0f}")
    lat = sampling["latency_ms"]
    print(f"\nsample ({args.groups} groups of {GROUP}, {args.policy}) + ack, {args.samples} round "
          f"trips, {sampling['stored_before']} -> {sampling['stored_after']} experiences of "
          f"{args.sample_tokens} tokens stored (filled in {sampling['fill_seconds']:.1f} s)")
    print(f"{'call':34} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    labels = {"store sample": "embedded store.sample (no RPC)",
              "store ack": "embedded store.ack (no RPC)",
              "sample": "service sample (RPC)", "ack": "service ack (RPC)",
              "sample+ack": "service sample+ack (RPC)"}
    for name, row in lat.items():
        print(f"{labels[name]:34} {row['p50']:8.2f} {row['p99']:8.2f} {row['mean']:8.2f}")

    best_service = max(median["service, 1 put in flight"], median["service, 4 puts in flight"])
    report = {
        "args": vars(args), "host": platform.node(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "put_exp_per_s_median": median, "put_exp_per_s_rounds": puts,
        "service_vs_raw": {name: rate / raw for name, rate in median.items()},
        "sampling": sampling,
        "targets": {"service_put_at_least_70pct_of_raw": best_service / raw >= 0.7,
                    "sample_p99_under_10ms": lat["sample"]["p99"] < 10.0},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
