"""Trainer throughput: training tokens/s of `Learner.step` next to a bare PyTorch loop.

For each model and micro-batch token budget, both loops train on the same batch (same
sequences, the same micro-batch split and padding, same precision, same optimiser), one after
the other in this process:

- bare:    per micro-batch  model(tokens).logits -> cross-entropy on the action tokens ->
           backward; then clip_grad_norm_ and AdamW.step. Nothing else.
- trainer: `Learner.step(experiences)`: batch building, GRPO advantages, logprobs, PPO-clip loss,
           metrics (entropy included unless --no-entropy-metric), clip, AdamW, schedule.

Models (random init): `tiny` (the test model) and `0.5b-shaped`: Qwen2.5-0.5B's width (hidden
896, MLP 4864, 14 heads, 2 KV heads, full 151936 vocabulary, tied embeddings) with only
`--layers` decoder layers (default 2 of 24) and a few short sequences, so that the default run
takes about two minutes on a small CPU; on a GPU pass `--device cuda --layers 24 --scale 8` for
the real depth and more tokens. `1.5b-shaped` is Qwen2.5-1.5B's width (hidden 1536, MLP 8960,
12 heads, 2 KV heads; `--layers 28` for its depth), for a GPU.

MFU (model FLOPs utilisation) is reported where the device's peak is known (`--peak-tflops`, or
the bf16 dense peak of an H100/H200 read from the device name): model FLOPs per real token are
6 x (decoder + output-projection parameters) + 12 x layers x hidden x mean sequence length
(PaLM's count, attention included, no recomputation), times tokens/s, over the peak. Tokens/s counts real (unpadded) tokens. Besides wall-clock ratios, the ratio
of CPU seconds per step is reported: on a machine shared with other work it is the steadier
measure of what each loop costs (use `--threads 1` so that idle OpenMP spinning is not counted).
Prints a table and writes JSON (`--out`).

    python tools/bench_trainer.py [--models tiny,0.5b-shaped] [--steps N] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


# Qwen2.5's widths: hidden, MLP, attention heads, KV heads
SHAPES = {"0.5b-shaped": (896, 4864, 14, 2), "1.5b-shaped": (1536, 8960, 12, 2)}

# bf16 dense tensor-core peak, TFLOP/s, by a word of torch.cuda.get_device_name()
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def build_model(kind: str, path: Path, layers: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tandem.weights.tiny import build_tiny_model

    if kind == "tiny":
        build_tiny_model(path)
        return
    hidden, mlp, heads, kv_heads = SHAPES[kind]
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         use_sliding_window=False, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))


def make_experiences(vocab: int, seqs: int, prompt_len: int, response_len: int, seed: int = 0):
    from tandem.common.messages.experience import Experience

    rng = np.random.default_rng(seed)
    out = []
    for i in range(seqs):
        # lengths vary a little, as real responses do, so padding is part of the measurement
        r = int(response_len * (0.75 + 0.25 * rng.random()))
        tokens = rng.integers(1, vocab, prompt_len + r).astype(np.int32)
        out.append(Experience(
            id=f"e{i}", task_id=f"t{i // 4}", group_id=f"t{i // 4}@v0", tokens=tokens,
            prompt_len=prompt_len, action_mask=np.ones(r, dtype=np.uint8),
            logprobs=np.full(r, -5.0, dtype=np.float32), reward=float(i % 2), policy_version=0))
    return out


def flops_per_token(path: Path, mean_len: float) -> float:
    """PaLM's model FLOPs per trained token: 6 N + 12 L d T (N without the input embedding)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(path))
    h, kv = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * c.intermediate_size  # q, o, k, v, MLP
    n = c.num_hidden_layers * per_layer + c.vocab_size * h  # + the output projection
    return 6 * n + 12 * c.num_hidden_layers * h * mean_len


def peak_tflops(device: str, given: float | None) -> float | None:
    if given or not device.startswith("cuda"):
        return given
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def bare_step(model, optimizer, batch, plan, device, autocast, max_norm):
    """The yardstick: forward, cross-entropy on action tokens, backward; clip; AdamW."""
    total = batch.mask.sum()
    for rows in plan:
        mb = batch.select(rows).to(device)
        with autocast():
            logits = model(input_ids=mb.tokens, attention_mask=mb.attention, use_cache=False).logits
        targets = mb.tokens[:, 1:].masked_fill(mb.mask == 0, -100)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=-100, reduction="sum") / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_one(model_path: Path, budget: int, experiences, steps: int, rounds: int, device: str,
              entropy_metric: bool, parallel: str = "auto") -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.common.config import RunConfig
    from tandem.trainer.batch import build_batch, plan_micro_batches
    from tandem.trainer.learner import Learner

    config = RunConfig.model_validate({
        "model": {"path": str(model_path)},
        "trainer": {"device": device, "micro_batch_tokens": budget, "lr": 1e-5,
                    "tensorboard": False, "entropy_metric": entropy_metric,
                    "parallel": parallel}})
    learner = Learner(config)
    dev = learner.device
    batch = build_batch(experiences, learner.pad_id)
    plan = plan_micro_batches(batch.lengths.tolist(), budget)
    tokens = int(batch.lengths.sum())

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(dev)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def timed(fn) -> list[tuple[float, float]]:
        """(wall seconds, CPU seconds of this process) per step, after one warm-up step."""
        fn()  # warm-up: allocator, kernels, optimiser state
        out = []
        for _ in range(steps):
            sync(dev)
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            sync(dev)
            out.append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    # alternate the two loops so that load from other processes hits both alike
    bare_t, trainer_t = [], []
    for _ in range(rounds):
        bare_t += timed(lambda: bare_step(model, optimizer, batch, plan, dev,
                                          learner._autocast, config.trainer.max_grad_norm))
        trainer_t += timed(lambda: learner.step(experiences))
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    return {"budget": budget, "mode": learner.mode,
            "flops_per_token": flops_per_token(model_path, tokens / batch.size), "micro_batches": len(plan), "tokens": tokens,
            "bare_tokens_per_s": tokens / med(bare_t, 0),
            "trainer_tokens_per_s": tokens / med(trainer_t, 0),
            "ratio": med(bare_t, 0) / med(trainer_t, 0),
            # CPU seconds per step: what the loop costs, whatever else the machine runs
            "bare_cpu_s": med(bare_t, 1), "trainer_cpu_s": med(trainer_t, 1),
            "cpu_ratio": med(bare_t, 1) / med(trainer_t, 1)}


# per model: sequences per step, prompt and response lengths, micro-batch token budgets
PRESETS = {
    "tiny": dict(seqs=16, prompt=16, response=48, budgets=[128, 512, 2048], steps=3, rounds=2),
    "0.5b-shaped": dict(seqs=4, prompt=8, response=32, budgets=[48, 192], steps=1, rounds=1),
    "1.5b-shaped": dict(seqs=4, prompt=8, response=32, budgets=[48, 192], steps=1, rounds=1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,0.5b-shaped",
                        help="comma-separated: tiny, 0.5b-shaped, 1.5b-shaped")
    parser.add_argument("--layers", type=int, default=2,
                        help="decoder layers of the shaped models")
    parser.add_argument("--scale", type=int, default=1,
                        help="multiply sequences per step and the token budgets")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per loop and round (default: per model)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="bare/trainer alternations (default: per model)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--parallel", default="auto", choices=["auto", "fsdp"],
                        help="trainer.parallel; fsdp: FSDP2 on one device (the bare loop is not "
                             "sharded)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak for MFU (default: known GPUs' bf16 dense peak)")
    parser.add_argument("--no-entropy-metric", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=".bench/trainer.json")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from tandem.common.logging import configure_logging
    configure_logging("bench", level="warning")

    peak = peak_tflops(args.device, args.peak_tflops)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            path = Path(tmp) / kind
            build_model(kind, path, args.layers)
            from transformers import AutoConfig
            vocab = AutoConfig.from_pretrained(str(path)).vocab_size
            preset = PRESETS[kind]
            experiences = make_experiences(vocab, preset["seqs"] * args.scale, preset["prompt"],
                                           preset["response"])
            for budget in preset["budgets"]:
                row = bench_one(path, budget * args.scale, experiences,
                                args.steps or preset["steps"], args.rounds or preset["rounds"],
                                args.device, not args.no_entropy_metric, args.parallel)
                row["model"] = kind
                for loop in ("bare", "trainer"):
                    row[f"{loop}_mfu"] = (row[f"{loop}_tokens_per_s"] * row["flops_per_token"]
                                          / (peak * 1e12) if peak else None)
                rows.append(row)
                print(f"{kind:12s} budget {budget:5d}  micro-batches {row['micro_batches']:2d}  "
                      f"bare {row['bare_tokens_per_s']:9.1f} tok/s  "
                      f"trainer {row['trainer_tokens_per_s']:9.1f} tok/s  "
                      f"ratio {row['ratio']:.2f}  cpu-time ratio {row['cpu_ratio']:.2f}"
                      + (f"  MFU bare {row['bare_mfu']:.1%} trainer {row['trainer_mfu']:.1%}"
                         if peak else ""), flush=True)

    print()
    print("| model | micro-batch tokens | micro-batches | bare tok/s | trainer tok/s | "
          "trainer / bare (wall) | trainer / bare (CPU time) | MFU bare | MFU trainer |")
    print("|---|---|---|---|---|---|---|---|---|")
    mfu = lambda x: f"{x:.1%}" if x is not None else "-"
    for r in rows:
        print(f"| {r['model']} | {r['budget']} | {r['micro_batches']} | "
              f"{r['bare_tokens_per_s']:.1f} | {r['trainer_tokens_per_s']:.1f} | "
              f"{r['ratio']:.2f} | "
              f"{r['cpu_ratio']:.2f} | {mfu(r['bare_mfu'])} | {mfu(r['trainer_mfu'])} |")
    from tandem.trainer import distributed
    distributed.shutdown()  # the one-rank group of --parallel fsdp, if any
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": args.device, "device_name": (torch.cuda.get_device_name(args.device)
                                               if args.device.startswith("cuda") else "cpu"),
        "peak_tflops": peak, "parallel": args.parallel, "torch": torch.__version__, "machine": platform.machine(),
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "layers_0.5b_shaped": args.layers, "scale": args.scale, "presets": PRESETS,
        "entropy_metric": not args.no_entropy_metric, "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
