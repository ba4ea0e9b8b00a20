"""Benchmark the reward functions: math checks/s and code evaluations/s, in-process vs service.

    .venv/bin/python tools/bench_reward.py [--workers 2] [--math-items 400] [--code-items 40]

Math: a mix of typical final answers (fractions, decimals, sets, intervals, wrong ones), scored
(a) on the main thread straight through math-verify (no isolation, the floor of the cost),
(b) by a LocalScorer, whose worker processes enforce the time limit, and (c) by the
tandem-reward service in its own process over loopback RPC. Code: a trivial passing program
with 5 stdin/stdout tests, each test one sandboxed run (fresh network and PID namespaces,
rlimits), in-process and through the service. The service and the in-process scorer run one
after the other in the same run, never at once, so they do not share the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    math_items, code_items = _items("math", args.math_items), _items("code", args.code_items)
    rows = []

    direct = MathReward(config)
    direct.score(math_items[0])  # math-verify's first call imports sympy
    start = time.perf_counter()
    for item in math_items:
        direct.score(item)
    rows.append(("math", "main thread, no isolation", len(math_items),
                 time.perf_counter() - start))

    async with LocalScorer(config=config) as local:
        await local.start()
        await local.score(math_items[:args.workers * 2] + code_items[:1])  # warm up
        for kind, items in (("math", math_items), ("code", code_items)):
            seconds, scores = await _timed(local, items, args.batch)
            _check(kind, scores)
            rows.append((kind, "in-process (LocalScorer)", len(items), seconds))

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "run.yaml"
        cfg.write_text(json.dumps({"run_dir": str(Path(tmp) / "run"), "logging": {"level": "warning"},
                                   "reward": {**config.model_dump(mode="json"), "address": address}}))
        proc = subprocess.Popen([sys.executable, "-m", "tandem.reward.cli", "--config", str(cfg)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            await _wait_ready(address, proc)
            async with RemoteScorer(address, timeout=300) as remote:
                await remote.score(math_items[:args.workers * 2] + code_items[:1])
                for kind, items in (("math", math_items), ("code", code_items)):
                    seconds, scores = await _timed(remote, items, args.batch)
                    _check(kind, scores)
                    rows.append((kind, "service (tandem-reward, loopback RPC)", len(items), seconds))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    results = [{"kind": kind, "path": path, "evaluations": n, "seconds": round(sec, 3),
                "per_second": round(n / sec, 2),
                "sandbox_runs_per_second": round(n * 5 / sec, 2) if kind == "code" else None}
               for kind, path, n, sec in rows]
    by = {(r["kind"], r["path"].split(" ")[0]): r["per_second"] for r in results}
    return {
        "machine": {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]},
        "workers": args.workers, "batch": args.batch, "results": results,
        "ratios": {
            "math_service_over_in_process": round(by[("math", "service")] / by[("math", "in-process")], 3),
            "code_service_over_in_process": round(by[("code", "service")] / by[("code", "in-process")], 3),
            "math_in_process_over_main_thread": round(by[("math", "in-process")] / by[("math", "main")], 3),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="reward.workers")
    parser.add_argument("--math-items", type=int, default=400)
    parser.add_argument("--code-items", type=int, default=40, help="evaluations of 5 tests each")
    parser.add_argument("--batch", type=int, default=64, help="items per score() call")
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
