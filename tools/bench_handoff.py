"""The hand-off of a step's experiences from the explorer to the trainer, stage by stage.

In a synchronous step nothing else runs while a batch goes from the explorer's last rollout to
the trainer's first forward pass: the explorer encodes its put, the buffer decodes it, stores it
(fsynced), wakes the trainer's parked sample, leases and reads the groups back, turns the rows
into experiences, encodes the reply, and the trainer decodes it. The same path carries the whole
batch at cluster scale (`tools/bench_scale.py`: the trainer's sample is the first thing that
breaks the control plane's budget). This tool times each stage of that path on one batch shape,
in this process (the embedded `SqliteStore` and the wire codec, no sockets), then the path end to
end through a `tandem-buffer` process (the put sent, then the parked sample's answer decoded), and
sets both against the same arrays pickled and unpickled (what moving the bytes costs without
messages, rows or validation).

    .venv/bin/python tools/bench_handoff.py [--shape quickstart --shape scale] [--steps 30]
        [--out .bench/handoff.json]

Shapes: `quickstart` is the quickstart's step (16 groups of 8, 10 prompt + 6 generated tokens);
`scale` is 64 groups of 8 experiences of 2,500 tokens (a quarter prompt), about 10 MB of arrays,
as 8 of bench_scale's explorers put in a step. Medians over `--steps` batches after 3 of warm-up.
Timings are reported, never pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_buffer import BufferProcess  # tools/ is the script's folder
from tandem.buffer import SqliteStore
from tandem.common.codec import decode, encode_reply, encode_request
from tandem.common.messages import (
    AckLease, Experience, GetBufferStats, PutExperiences, SampleGroups, SampleResult,
    experience_id, group_id,
)
from tandem.common.rpc import RpcClient

GROUP = 8
SHAPES = {"quickstart": (16, 16, 10), "scale": (64, 2500, 625)}  # groups, tokens, prompt
WARMUP = 3
STAGES = ["put: encode (explorer)", "put: decode (buffer)", "put: store, fsynced (buffer)",
          "sample: lease + read rows (buffer)", "sample: rows -> experiences (buffer)",
          "sample: encode reply (buffer)", "sample: decode reply (trainer)"]


def batch(step: int, groups: int, tokens: int, prompt: int) -> list[Experience]:
    """One step's experiences, distinct per step (ids name the step)."""
    rng = np.random.default_rng(step)
    out = []
    for g in range(groups):
        task = f"s{step}-t{g}"
        for i in range(GROUP):
            out.append(Experience(
                id=experience_id(task, i, 0, "bench"), task_id=task, group_id=group_id(task, step),
                tokens=rng.integers(0, 150_000, tokens, dtype=np.int32), prompt_len=prompt,
                action_mask=np.ones(tokens - prompt, dtype=np.uint8),
                logprobs=rng.standard_normal(tokens - prompt).astype(np.float32),
                reward=float(i % 2), policy_version=step, explorer="bench"))
    return out


def array_bytes(groups: int, tokens: int, prompt: int) -> int:
    """The bytes of one batch's arrays: int32 tokens, uint8 mask and float32 logprobs."""
    return groups * GROUP * (4 * tokens + 5 * (tokens - prompt))


async def stages(root: Path, shape: tuple[int, int, int], steps: int) -> dict[str, list[float]]:
    """Each stage of the path in this process, one batch at a time."""
    groups = shape[0]
    root.mkdir(parents=True, exist_ok=True)
    store = SqliteStore(root / "stages.sqlite", capacity=10**7)  # synchronous=full: fsynced
    times: dict[str, list[float]] = {name: [] for name in [*STAGES, "pickled arrays (baseline)"]}

    def timed(name: str, fn, step: int):
        start = time.perf_counter()
        result = fn()
        if step >= WARMUP:
            times[name].append(time.perf_counter() - start)
        return result

    async def timed_async(name: str, call, step: int):
        start = time.perf_counter()
        result = await call
        if step >= WARMUP:
            times[name].append(time.perf_counter() - start)
        return result

    try:
        for step in range(steps + WARMUP):
            experiences = batch(step, *shape)
            frames = timed(STAGES[0], lambda: encode_request(
                PutExperiences(experiences=experiences, group_size=GROUP), "put"), step)
            put = timed(STAGES[1], lambda: decode(frames).body, step)
            await timed_async(STAGES[2], store.put(put.experiences,
                                                   [GROUP] * len(put.experiences)), step)
            leased = await timed_async(STAGES[3], store.writer.call(
                store._op_sample, groups, store.policy, None, None, None, "trainer", groups), step)
            lease = timed(STAGES[4], lambda: store.lease_from(leased), step)
            reply = SampleResult(lease_id=lease.lease_id, expires_at=lease.expires_at,
                                 experiences=lease.experiences, group_ids=lease.group_ids)
            answer = timed(STAGES[5], lambda: encode_reply("sample", reply), step)
            got = timed(STAGES[6], lambda: decode(answer, reply_type=SampleResult), step)
            assert len(got.body.experiences) == len(experiences)
            await store.ack(lease.lease_id)
            arrays = [(e.tokens, e.action_mask, e.logprobs) for e in experiences]
            timed("pickled arrays (baseline)",
                  lambda: pickle.loads(pickle.dumps(arrays, protocol=5)), step)
    finally:
        await store.close()
    return times


async def end_to_end(root: Path, shape: tuple[int, int, int], steps: int
                     ) -> dict[str, list[float]]:
    """The put sent by an explorer client, the trainer's sample parked before it: until the put
    is acked, and until the sample's answer is decoded (what a synchronous step waits)."""
    groups = shape[0]
    (root / "service").mkdir(parents=True, exist_ok=True)
    process = BufferProcess(root / "service")
    explorer = RpcClient(process.address, peer="buffer", name="explorer")
    trainer = RpcClient(process.address, peer="buffer", name="trainer")
    times: dict[str, list[float]] = {"put acked": [], "sample answered after the ack": [],
                                     "put sent -> sample answered": []}
    try:
        for client in (explorer, trainer):
            await client.call(GetBufferStats(), timeout=60, retries=0)  # connected first
        for step in range(steps + WARMUP):
            experiences = batch(10_000 + step, *shape)
            answered: list[float] = []

            async def sample() -> SampleResult:
                result = await trainer.call(
                    SampleGroups(num_groups=groups, wait=30, holder="trainer"),
                    timeout=60, retries=0)
                answered.append(time.perf_counter())
                return result

            parked = asyncio.create_task(sample())
            await asyncio.sleep(0.05)  # the sample is parked in the buffer before the put
            sent = time.perf_counter()
            await explorer.call(PutExperiences(experiences=experiences, group_size=GROUP),
                                timeout=60, retries=0)
            acked = time.perf_counter()
            lease = await parked
            await trainer.call(AckLease(lease_id=lease.lease_id), timeout=60, retries=0)
            if step >= WARMUP:
                times["put acked"].append(acked - sent)
                times["sample answered after the ack"].append(answered[0] - acked)
                times["put sent -> sample answered"].append(answered[0] - sent)
    finally:
        await explorer.close()
        await trainer.close()
        process.stop()
    return times


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", choices=list(SHAPES),
                        help="batch shapes to measure (default: both)")
    parser.add_argument("--steps", type=int, default=30, help="batches timed per shape")
    parser.add_argument("--out", default=".bench/handoff.json")
    args = parser.parse_args()
    shapes = args.shape or list(SHAPES)
    root = Path(tempfile.mkdtemp(prefix="bench-handoff-", dir=os.environ.get("BENCH_TMP")))
    report: dict = {"args": vars(args), "host": platform.node(), "cpus": os.cpu_count(),
                    "load_before": os.getloadavg()[0], "shapes": {}}
    try:
        for name in shapes:
            shape = SHAPES[name]
            inner = asyncio.run(stages(root / name, shape, args.steps))
            outer = asyncio.run(end_to_end(root / name, shape, args.steps))
            timings = {**inner, **outer}
            experiences = shape[0] * GROUP
            mb = array_bytes(*shape) / 1e6
            medians = {k: median_ms(v) for k, v in timings.items()}
            total = sum(medians[s] for s in STAGES)
            report["shapes"][name] = {
                "groups": shape[0], "experiences": experiences, "tokens": shape[1],
                "array_mb": mb, "median_ms": medians, "stages_total_ms": total,
                "vs_pickled": total / medians["pickled arrays (baseline)"], "seconds": timings}
            print(f"\n{name}: {shape[0]} groups x {GROUP} = {experiences} experiences of "
                  f"{shape[1]} tokens, {mb:.2f} MB of arrays; medians of {args.steps} batches")
            print(f"{'stage':40} {'ms':>8} {'share':>6}")
            for stage in STAGES:
                print(f"{stage:40} {medians[stage]:8.2f} {medians[stage] / total:6.0%}")
            print(f"{'the stages together':40} {total:8.2f}")
            base = medians["pickled arrays (baseline)"]
            print(f"{'pickled arrays (baseline)':40} {base:8.2f}   stages / baseline "
                  f"{total / base:.1f}x")
            for key in ("put acked", "sample answered after the ack",
                        "put sent -> sample answered"):
                print(f"{'process: ' + key:40} {medians[key]:8.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["load_after"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nload {report['load_before']:.1f} -> {report['load_after']:.1f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
