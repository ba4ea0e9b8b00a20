"""Barrier round trip of the master: an explorer reports a step done -> its next Barrier arrives.

The master runs as its own process (`tandem-master`, journal on) on loopback TCP; 1, 4 and 16
explorers run in this process, each looping report -> wait for barrier as fast as it can, all
at once. The plan never makes an explorer wait for the trainer (asynchronous, staleness bound
larger than the run), so what is measured is the master's own path: RPC in, journal append,
SyncPlan decision, PUB out, SUB in, plus the reply.

    .venv/bin/python tools/bench_master.py [--rounds 400] [--explorers 1,4,16] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.common.errors import PeerDead
from tandem.common.messages.base import Heartbeat
from tandem.common.messages.master import ExplorerStepDone, GetStatus, Register, barrier_topic
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.common.sockets import free_port


def start_master(workdir: Path, explorers: int, steps: int) -> tuple[subprocess.Popen, str, str]:
    rpc, pub = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    names = "".join(f"  - name: explorer-{i}\n" for i in range(explorers))
    config = workdir / f"run-{explorers}.yaml"
    config.write_text(
        f"run_dir: {workdir / f'run-{explorers}'}\n"
        f"sync: {{preset: fully_async, max_staleness: {steps}}}\n"
        f"master: {{address: '{rpc}', publish_address: '{pub}', total_steps: {steps}}}\n"
        f"logging: {{level: warning}}\n"
        f"transport: {{liveness: 60}}\n"
        f"explorers:\n{names}")
    exe = Path(sys.executable).with_name("tandem-master")
    proc = subprocess.Popen([str(exe), "--config", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    return proc, rpc, pub


async def explorer(name: str, rpc: str, pub: str, rounds: int, warmup: int,
                   ready: asyncio.Barrier) -> list[float]:
    client = RpcClient(rpc, peer="master", name=name)
    snap = RpcClient(rpc, peer="master", name=name + "-snapshot")
    sub = Subscriber(pub, topics=[barrier_topic(name)], snapshot=snap)
    await sub.start()
    for _ in range(100):  # the master process may still be starting
        try:
            await client.call(GetStatus(), timeout=0.5, retries=0)
            break
        except PeerDead:
            await asyncio.sleep(0.1)
    else:
        raise RuntimeError(f"master at {rpc} did not answer")
    await client.call(Register(name=name, role="explorer"), timeout=10)
    barrier = (await sub.recv(10, what="first barrier")).body
    while barrier.explorer != name:
        barrier = (await sub.recv(10, what="first barrier")).body
    await ready.wait()
    began = time.perf_counter()
    samples = []
    for i in range(rounds + warmup):
        start = time.perf_counter()
        await client.call(ExplorerStepDone(explorer=name, step=barrier.step, batch=barrier.batch,
                                           version=barrier.version), timeout=10)
        last = barrier.batch
        # a repeated decision (a snapshot after a gap) is not the next one
        while barrier.explorer != name or barrier.batch <= last:
            barrier = (await sub.recv(10, what="barrier")).body
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    ended = time.perf_counter()
    # the same explorers, now a bare RPC round trip (heartbeat), as the yardstick
    await ready.wait()
    bare = []
    for _ in range(rounds):
        start = time.perf_counter()
        await client.call(Heartbeat(name=name, role="explorer"), timeout=10)
        bare.append(time.perf_counter() - start)
    await sub.close()
    await snap.close()
    await client.close()
    return samples, began, ended, bare


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(n: int, rounds: int, warmup: int, workdir: Path) -> dict:
    steps = (rounds + warmup + 10) * n
    proc, rpc, pub = start_master(workdir, n, steps)
    try:
        ready = asyncio.Barrier(n)
        results = await asyncio.gather(*[explorer(f"explorer-{i}", rpc, pub, rounds, warmup,
                                                  ready) for i in range(n)])
        wall = max(r[2] for r in results) - min(r[1] for r in results)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    samples = [s for r in results for s in r[0]]
    bare = [s for r in results for s in r[3]]
    return dict(explorers=n, samples=len(samples), p50_ms=pct(samples, 0.5) * 1e3,
                p99_ms=pct(samples, 0.99) * 1e3, mean_ms=statistics.fmean(samples) * 1e3,
                max_ms=max(samples) * 1e3, reports_per_s=len(samples) / wall,
                rpc_p50_ms=pct(bare, 0.5) * 1e3, rpc_p99_ms=pct(bare, 0.99) * 1e3,
                load_average=os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="measured rounds per explorer")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--explorers", default="1,4,16")
    parser.add_argument("--out", default=".bench/master.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-master-") as tmp:
        for n in [int(x) for x in args.explorers.split(",")]:
            rows.append(asyncio.run(measure(n, args.rounds, args.warmup, Path(tmp))))
    print(f"barrier round trip (report -> next Barrier), master in its own process, loopback TCP,"
          f" {os.cpu_count()} CPUs; 'rpc' = a bare heartbeat round trip by the same explorers")
    print(f"{'explorers':>9} {'samples':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} "
          f"{'max ms':>8} {'reports/s':>10} {'rpc p50':>8} {'rpc p99':>8} {'p50/rpc':>8} "
          f"{'load':>5}")
    for r in rows:
        r["p50_vs_rpc"] = r["p50_ms"] / r["rpc_p50_ms"]
        print(f"{r['explorers']:>9} {r['samples']:>8} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
              f"{r['mean_ms']:>8.3f} {r['max_ms']:>8.3f} {r['reports_per_s']:>10.0f} "
              f"{r['rpc_p50_ms']:>8.3f} {r['rpc_p99_ms']:>8.3f} {r['p50_vs_rpc']:>7.2f}x "
              f"{r['load_average']:>5.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(benchmark="master_barrier_round_trip", rounds=args.rounds,
                                   results=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
