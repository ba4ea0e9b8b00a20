"""Benchmark a reward worker pool's start: wall-clock, CPU, memory, and a worker's replacement.

    .venv/bin/python tools/bench_reward_pool.py [--workers 4] [--rounds 3]
                                                [--trees . /path/to/other/checkout]
                                                [--out .bench/reward_pool.json]

Each round starts a `WorkerPool` of `--workers` workers for `reward.functions: {math: 1}` (the
function whose imports, math-verify and sympy, cost the most), in a fresh process, and
measures: the wall-clock of `start()` until every worker is ready; the CPU seconds of every
process the pool started (`RUSAGE_CHILDREN` of that process once the pool is closed: the
workers and whatever started them, all reaped); the PSS of the pool's processes once ready
(`/proc/<pid>/smaps_rollup`); and the wall-clock of replacing a worker (`_spawn()` once more, as
after a kill). With several `--trees` (checkouts of tandem, e.g. a worktree of an older commit),
each round runs every tree in turn, so a before/after pair shares the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            text = Path(f"/proc/{parent}/task/{parent}/children").read_text()
        except OSError:
            continue
        below = [int(p) for p in text.split()]
        found += below
        frontier += below
    return found


def _pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


async def _one(workers: int) -> dict:
    from tandem.common.config.reward import RewardConfig
    from tandem.reward.pool import WorkerPool

    pool = WorkerPool(RewardConfig(functions={"math": 1.0}, workers=workers))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    await pool.start()
    start_s = time.perf_counter() - t0
    pss = _pss_mib(_descendants(os.getpid()))
    t0 = time.perf_counter()
    extra = await pool._spawn()  # what a replacement costs after a worker is killed
    replace_s = time.perf_counter() - t0
    await extra.kill()
    await pool.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"start_s": start_s, "cpu_s": cpu, "pss_mib": pss, "replace_s": replace_s}


def _run_tree(tree: Path, workers: int) -> dict:
    src = os.pathsep.join(str(p) for p in sorted((tree / "packages").glob("*/src")))
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, __file__, "--one", "--workers", str(workers)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="reward.workers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trees", nargs="+", default=[str(REPO)],
                        help="tandem checkouts to compare, each round in turn")
    parser.add_argument("--out", default=".bench/reward_pool.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(_one(args.workers))))
        return
    trees = [Path(t).resolve() for t in args.trees]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    loads = []
    for _ in range(args.rounds):
        for tree in trees:
            loads.append(os.getloadavg()[0])
            runs[str(tree)].append(_run_tree(tree, args.workers))
    rows = []
    for tree in trees:
        mine = runs[str(tree)]
        rows.append({"tree": str(tree), "commit": _commit(tree), **{
            key: statistics.median(r[key] for r in mine)
            for key in ("start_s", "cpu_s", "pss_mib", "replace_s")}})
    print(f"reward pool of {args.workers} workers (math), median of {args.rounds} rounds, "
          f"load {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'commit':>10} {'start s':>8} {'CPU s':>7} {'PSS MiB':>8} {'replace s':>10}")
    for row in rows:
        print(f"{row['commit']:>10} {row['start_s']:8.2f} {row['cpu_s']:7.2f} "
              f"{row['pss_mib']:8.0f} {row['replace_s']:10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workers": args.workers, "rounds": args.rounds,
                                          "loads": loads, "rows": rows, "runs": runs},
                                         indent=2))


if __name__ == "__main__":
    main()
