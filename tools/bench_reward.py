"""Benchmark the reward functions: math checks/s and code evaluations/s, in-process vs service.

    .venv/bin/python tools/bench_reward.py [--workers 2] [--math-items 320] [--code-items 32]
                                           [--rounds 4] [--out .bench/reward.json]

Math: a mix of typical final answers (fractions, decimals, sets, intervals, wrong ones), scored
(a) on the main thread straight through math-verify (no isolation, the floor of the cost),
(b) by a LocalScorer, whose worker processes enforce the time limit, and (c) by the
tandem-reward service in its own process over loopback RPC. Code: a trivial passing program
with 5 stdin/stdout tests, each test one sandboxed run (bubblewrap: a minimal read-only root,
fresh PID, network, IPC and UTS namespaces, a tmpfs /tmp, a memory cgroup, rlimits, the slot's
uid), in-process and through the service. The paths take turns in `--rounds` slices in the
same run, never at once, so they neither share the CPUs nor see different machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from tandem.common.sockets import free_port

# Templates filled with the item's index, so every item is new to math-verify's parse caches.
MATH = [
    ("The answer is \\boxed{{\\frac{{{i}}}{{{j}}}}}", "{i}/{j}"),
    ("so $x = {i}$ and \\boxed{{{i}.0}}", "{i}"),
    ("\\boxed{{\\{{{i}, {j}\\}}}}", "\\{{{j},{i}\\}}"),
    ("\\boxed{{({i}, {j}]}}", "({i},{j}]"),
    ("\\boxed{{{i}\\sqrt{{2}}}}", "\\sqrt{{{k}}}"),
    ("\\boxed{{0.{i}}}", "\\frac{{{i}}}{{{j}}}"),
    ("We get \\boxed{{{j}}}", "{i}"),
    ("\\boxed{{x^2 + {d}x + {i}}}", "(x+{i})^2"),
]
CODE = "```python\nimport sys\nprint(int(sys.stdin.readline()) * 2)\n```"
CODE_TRUTH = {"tests": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(5)]}


def _items(kind: str, n: int):
    from tandem.common.messages.reward import ScoreItem

    if kind == "math":
        items = []
        for n_ in range(n):
            response, truth = MATH[n_ % len(MATH)]
            values = {"i": n_ + 2, "j": n_ + 3, "k": 2 * (n_ + 2) ** 2, "d": 2 * (n_ + 2)}
            items.append(ScoreItem(fn="math", response=response.format(**values),
                                   truth=truth.format(**values)))
        return items
    return [ScoreItem(fn="code", response=CODE, truth=CODE_TRUTH) for _ in range(n)]


async def _timed(scorer, items, batch: int) -> tuple[float, list]:
    start = time.perf_counter()
    scores = []
    for i in range(0, len(items), batch):
        scores += await scorer.score(items[i:i + batch])
    return time.perf_counter() - start, scores


def _check(kind: str, scores) -> None:
    if kind == "code":
        bad = [s for s in scores if s.score != 1.0]
    else:
        bad = [s for s in scores if s.reason in ("timeout",) or s.reason.startswith("error")]
    if bad:
        raise SystemExit(f"bench_reward: {len(bad)} {kind} evaluations failed, e.g. {bad[0]}")


async def _wait_ready(address: str, proc: subprocess.Popen) -> None:
    from tandem.common.errors import PeerDead
    from tandem.common.messages.reward import ScoreItem
    from tandem.reward import RemoteScorer

    deadline = time.monotonic() + 120
    async with RemoteScorer(address, timeout=5) as remote:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"bench_reward: tandem-reward exited with {proc.returncode}")
            try:
                await remote.score([ScoreItem(fn="format", response="x")])
                return
            except PeerDead:
                continue
    raise SystemExit("bench_reward: tandem-reward did not answer within 120s")


async def bench(args) -> dict:
    from tandem.common.config.reward import RewardConfig
    from tandem.reward import LocalScorer, RemoteScorer
    from tandem.reward.functions.math_answer import MathReward

    config = RewardConfig(functions={"math": 1.0, "code": 1.0}, workers=args.workers,
                          timeout=30.0)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    tmp = tempfile.TemporaryDirectory()
    cfg = Path(tmp.name) / "run.yaml"
    cfg.write_text(json.dumps({"run_dir": str(Path(tmp.name) / "run"),
                               "logging": {"level": "warning"},
                               "reward": {**config.model_dump(mode="json"), "address": address}}))
    proc = subprocess.Popen([sys.executable, "-m", "tandem.reward.cli", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    direct = MathReward(config)
    paths = {"math": ["main", "local", "service"], "code": ["local", "service"]}
    counts = {"math": args.math_items, "code": args.code_items}
    # Every path gets its own items (so no path finds another's answers in math-verify's
    # caches), in `rounds` slices taken in turn, so a change in machine load hits all paths.
    items = {kind: {path: _items(kind, counts[kind] * (i + 1))[counts[kind] * i:]
                    for i, path in enumerate(paths[kind])} for kind in paths}
    totals = {(kind, path): 0.0 for kind in paths for path in paths[kind]}
    try:
        async with LocalScorer(config=config) as local, \
                RemoteScorer(address, timeout=300) as remote:
            await _wait_ready(address, proc)
            await local.start()
            warm = _items("math", args.workers * 2) + _items("code", 1)
            await local.score(warm)
            await remote.score(warm)
            direct.score(warm[0])
            scorers = {"local": local, "service": remote}
            for kind, kind_paths in paths.items():
                size = -(-counts[kind] // args.rounds)
                for r in range(args.rounds):
                    for path in kind_paths:
                        chunk = items[kind][path][r * size:(r + 1) * size]
                        if path == "main":
                            start = time.perf_counter()
                            for item in chunk:
                                direct.score(item)
                            totals[(kind, path)] += time.perf_counter() - start
                            continue
                        seconds, scores = await _timed(scorers[path], chunk, args.batch)
                        _check(kind, scores)
                        totals[(kind, path)] += seconds
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        tmp.cleanup()

    names = {"main": "main thread, no isolation", "local": "in-process (LocalScorer)",
             "service": "service (tandem-reward, loopback RPC)"}
    results = []
    for (kind, path), sec in totals.items():
        n = counts[kind]
        results.append({"kind": kind, "path": names[path], "evaluations": n,
                        "seconds": round(sec, 3), "per_second": round(n / sec, 2),
                        "sandbox_runs_per_second": round(n * 5 / sec, 2) if kind == "code"
                        else None})
    rate = {key: counts[key[0]] / sec for key, sec in totals.items()}

    def ratio(kind: str, a: str, b: str) -> float:
        return round(rate[(kind, a)] / rate[(kind, b)], 3)

    return {
        "machine": {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]},
        "workers": args.workers, "batch": args.batch, "rounds": args.rounds, "results": results,
        "ratios": {
            "math_service_over_in_process": ratio("math", "service", "local"),
            "code_service_over_in_process": ratio("code", "service", "local"),
            "math_in_process_over_main_thread": ratio("math", "local", "main"),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="reward.workers")
    parser.add_argument("--math-items", type=int, default=320)
    parser.add_argument("--code-items", type=int, default=32, help="evaluations of 5 tests each")
    parser.add_argument("--batch", type=int, default=64, help="items per score() call")
    parser.add_argument("--rounds", type=int, default=4, help="slices each path takes in turn")
    parser.add_argument("--out", default=".bench/reward.json")
    args = parser.parse_args()

    import logging

    from tandem.common.logging import configure_logging

    configure_logging("bench", level="warning")
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    report = asyncio.run(bench(args))

    print(f"{'kind':5} {'path':40} {'n':>5} {'seconds':>8} {'per s':>8} {'runs/s':>7}")
    for r in report["results"]:
        runs = f"{r['sandbox_runs_per_second']:7.1f}" if r["sandbox_runs_per_second"] else ""
        print(f"{r['kind']:5} {r['path']:40} {r['evaluations']:5d} {r['seconds']:8.2f} "
              f"{r['per_second']:8.1f} {runs}")
    for name, value in report["ratios"].items():
        print(f"{name}: {value}")
    print(f"cpus={report['machine']['cpus']} load_1m={report['machine']['load_1m']:.2f} "
          f"workers={report['workers']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
