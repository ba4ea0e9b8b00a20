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
takes about two minutes on a small CPU; on a GPU pass `--layers 24 --scale 8` for the real depth
and more tokens. Tokens/s counts real (unpadded) tokens. Besides wall-clock ratios, the ratio
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


def build_model(kind: str, path: Path, layers: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tandem.weights.tiny import build_tiny_model

    if kind == "tiny":
        build_tiny_model(path)
        return
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
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
              entropy_metric: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.common.config import RunConfig
    from tandem.trainer.batch import build_batch, plan_micro_batches
    from tandem.trainer.learner import Learner

    config = RunConfig.model_validate({
        "model": {"path": str(model_path)},
        "trainer": {"device": device, "micro_batch_tokens": budget, "lr": 1e-5,
                    "tensorboard": False, "entropy_metric": entropy_metric}})
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
    return {"budget": budget, "micro_batches": len(plan), "tokens": tokens,
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
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,0.5b-shaped")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of 0.5b-shaped")
    parser.add_argument("--scale", type=int, default=1,
                        help="multiply sequences per step and the token budgets")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per loop and round (default: per model)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="bare/trainer alternations (default: per model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
                                args.device, not args.no_entropy_metric)
                row["model"] = kind
                rows.append(row)
                print(f"{kind:12s} budget {budget:5d}  micro-batches {row['micro_batches']:2d}  "
                      f"bare {row['bare_tokens_per_s']:9.1f} tok/s  "
                      f"trainer {row['trainer_tokens_per_s']:9.1f} tok/s  "
                      f"ratio {row['ratio']:.2f}  cpu-time ratio {row['cpu_ratio']:.2f}",
                      flush=True)

    print()
    print("| model | micro-batch tokens | micro-batches | bare tok/s | trainer tok/s | "
          "trainer / bare (wall) | trainer / bare (CPU time) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['budget']} | {r['micro_batches']} | "
              f"{r['bare_tokens_per_s']:.1f} | {r['trainer_tokens_per_s']:.1f} | "
              f"{r['ratio']:.2f} | "
              f"{r['cpu_ratio']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": args.device, "torch": torch.__version__, "machine": platform.machine(),
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "layers_0.5b_shaped": args.layers, "scale": args.scale, "presets": PRESETS,
        "entropy_metric": not args.no_entropy_metric, "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
