"""Benchmark streaming rollouts: when do a step's groups reach the buffer?

One explorer step of `--tasks` tasks x `--repeat` responses through the `single_turn` workflow
and the transformers engine (a tiny model built here, CPU, one torch thread), each group put
into a real `SqliteStore` (synchronous=full). Streamed: each group is put as soon as it is
scored; not streamed: the step's groups are put together at its end. Reported per mode: the
seconds from the step's start to the first group stored, to the median group, and to the last,
the median of `--rounds` interleaved rounds. The engine's batch is `--max-batch` rows, so a step
of more rows runs as several batches one after the other, as on a real engine at its limit.

Then across step boundaries: `--runs` interleaved pairs of real `tandem up` runs (fully_async,
one explorer, `--steps` steps of `--tasks` tasks, the same engine batch), with
`explorers[].lease_ahead` off (the next step is leased after this one is reported) and on (it
is asked for once this step's first group is scored, and leased while this one drains). Per
step boundary the engine's idle gap is read from the trace: from the moment the step's last
group was scored (its rollout span's `generated`) to the start of the next step's rollout
(tasks leased and handed to the engine), 0 when the next step was handed over first.

    .venv/bin/python tools/bench_streaming.py [--tasks 8] [--repeat 4] [--max-batch 8] \
        [--steps 6] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tandem.buffer import SqliteStore
from tandem.common.messages.experience import Task
from tandem.common.messages.reward import Score
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.explorer.workflows import RolloutContext, create_workflow
from tandem.weights.tiny import build_tiny_model


class LengthScorer:
    async def score(self, items):
        return [Score(score=float(len(it.response))) for it in items]


async def one_step(engine, wf, store, tasks, args, streamed: bool) -> list[float]:
    t0 = time.perf_counter()
    stored: list[float] = []

    async def put(group):
        await store.put(group, [len(group)] * len(group))
        stored.append(time.perf_counter() - t0)

    ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=args.max_tokens),
                         repeat_times=args.repeat, explorer="bench", run=f"r{time.time_ns()}",
                         scorer=LengthScorer(), on_group=put if streamed else None)
    experiences = await wf.run(tasks, ctx)
    if not streamed:
        groups: dict[str, list] = {}
        for e in experiences:
            groups.setdefault(e.group_id, []).append(e)
        await store.put(experiences, [args.repeat] * len(experiences))
        stored += [time.perf_counter() - t0] * len(groups)
    return sorted(stored)


def boundary_gaps(config) -> tuple[list[float], float]:
    """One real run: the engine's idle seconds at each step boundary, and the run's seconds."""
    from tandem.common.trace import read_trace
    from tandem.master.up import run_up

    t0 = time.perf_counter()
    if run_up(config, live=False) != 0:
        raise SystemExit(f"the run in {config.run_dir} failed; see its logs/")
    seconds = time.perf_counter() - t0
    rollouts = sorted((s for s in read_trace(config.run_dir) if s["kind"] == "rollout"),
                      key=lambda s: s["step"])
    return [max(0.0, b["start"] - a["attrs"]["generated"])
            for a, b in itertools.pairwise(rollouts)], seconds


def run_config(run_dir: Path, model: Path, taskset: Path, args, lease_ahead: bool):
    from tandem.common.config import RunConfig

    return RunConfig.model_validate({
        "name": "bench-streaming", "run_dir": str(run_dir), "model": {"path": str(model)},
        "sync": {"preset": "fully_async", "max_staleness": args.steps, "timeout": 120},
        "master": {"total_steps": args.steps, "taskset": {"path": str(taskset), "epochs": 50}},
        "explorers": [{"name": "explorer-0", "batch_size": args.tasks,
                       "repeat_times": args.repeat, "lease_ahead": lease_ahead,
                       "engine": {"max_batch": args.max_batch},
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": args.max_tokens}}],
        "trainer": {"groups_per_step": args.tasks, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "logging": {"level": "warning"},
        "up": {"run_timeout": 600},
    })


def across_steps(args, model: Path, tmp: Path) -> None:
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(0)
    taskset = write_jsonl(train, tmp / "train.jsonl")
    modes = {"after report": False, "lease ahead": True}
    gaps: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.runs):  # interleaved, so both modes see the same machine load
        for mode, ahead in modes.items():
            config = run_config(tmp / f"run-{r}-{int(ahead)}", model, taskset, args, ahead)
            g, seconds = boundary_gaps(config)
            gaps[mode] += g
            walls[mode].append(seconds)
    print(f"\nacross steps: fully_async, 1 explorer, {args.steps} steps of {args.tasks} tasks x "
          f"{args.repeat}, max_batch {args.max_batch}; {args.runs} runs per mode, "
          f"{args.runs * (args.steps - 1)} step boundaries")
    print(f"{'mode':<13} {'gap median':>11} {'gap mean':>9} {'gap max':>8} {'run (tandem up)':>16}")
    for mode in modes:
        g = gaps[mode]
        print(f"{mode:<13} {statistics.median(g):>11.3f} {statistics.mean(g):>9.3f} "
              f"{max(g):>8.3f} {statistics.median(walls[mode]):>16.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps per run across boundaries")
    ap.add_argument("--runs", type=int, default=2, help="runs per mode across boundaries (0: "
                                                        "skip)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(Path(tmp) / "model")
        engine = TransformersEngine.from_pretrained(Path(tmp) / "model", max_batch=args.max_batch)
        wf = create_workflow("single_turn", engine.tokenizer)
        store = SqliteStore(Path(tmp) / "buffer.sqlite")
        tasks = [Task(id=f"t{i}", payload={"prompt": f"{i}*{i}="}) for i in range(args.tasks)]
        results: dict[str, list[list[float]]] = {"streamed": [], "at step end": []}
        for _ in range(args.rounds):  # interleaved, so both modes see the same machine load
            results["streamed"].append(asyncio.run(one_step(engine, wf, store, tasks, args, True)))
            results["at step end"].append(
                asyncio.run(one_step(engine, wf, store, tasks, args, False)))
        store.close_sync()
        engine.close()
    print(f"{args.tasks} tasks x {args.repeat} responses, max_batch {args.max_batch}, "
          f"max_tokens {args.max_tokens}; median of {args.rounds} rounds, seconds from step start")
    print(f"{'mode':<12} {'first group':>12} {'median group':>13} {'last group':>11}")
    for mode, rounds in results.items():
        first = statistics.median(r[0] for r in rounds)
        mid = statistics.median(r[len(r) // 2] for r in rounds)
        last = statistics.median(r[-1] for r in rounds)
        print(f"{mode:<12} {first:>12.3f} {mid:>13.3f} {last:>11.3f}")
    if args.runs:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the runs' processes, one thread each
        with tempfile.TemporaryDirectory() as tmp:
            build_tiny_model(Path(tmp) / "model")
            across_steps(args, Path(tmp) / "model", Path(tmp))


if __name__ == "__main__":
    main()
