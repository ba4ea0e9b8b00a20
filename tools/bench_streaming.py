"""Benchmark streaming rollouts: when do a step's groups reach the buffer?

One explorer step of `--tasks` tasks x `--repeat` responses through the `single_turn` workflow
and the transformers engine (a tiny model built here, CPU, one torch thread), each group put
into a real `SqliteStore` (synchronous=full). Streamed: each group is put as soon as it is
scored; not streamed: the step's groups are put together at its end. Reported per mode: the
seconds from the step's start to the first group stored, to the median group, and to the last,
the median of `--rounds` interleaved rounds. The engine's batch is `--max-batch` rows, so a step
of more rows runs as several batches one after the other, as on a real engine at its limit.

    .venv/bin/python tools/bench_streaming.py [--tasks 8] [--repeat 4] [--max-batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
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


if __name__ == "__main__":
    main()
