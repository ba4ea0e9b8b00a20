"""`tandem quickstart` (what `make run` runs): learn a task from nothing on CPU.

1. Build a tiny causal LM (a Qwen2 config, about 1M parameters) and a character tokenizer.
2. Make a synthetic task with a verifiable answer: reverse the digits of a number
   (`rev 472=` -> `274`); train and held-out prompts never overlap.
3. Warm-start the model with a short SFT on the training prompts, deliberately brief so the
   policy knows the format but is often wrong.
4. Improve it with GRPO through the full system (`tandem up`: master, buffer, trainer,
   explorers as separate processes; rewards by the `k12` short-answer check).
5. Measure held-out accuracy before and after with the run's own evaluation (the `eval`
   section: the explorer scores the held-out prompts between its steps, into
   run_dir/eval.jsonl): the share of sampled answers (temperature 1, the policy as it
   explores) that the `k12` check marks right, plus greedy accuracy and pass@4.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import click

from tandem.common.config import RunConfig
from tandem.common.sync import PRESETS, preset_explorers

MODEL = dict(hidden=192, layers=2, heads=4, kv_heads=2, intermediate=576, max_positions=64)


def reversal_tasks(seed: int = 0, digits: int = 3, heldout: int = 100) -> tuple[list, list]:
    """Every `digits`-digit number once, shuffled; the first `heldout` are held out."""
    numbers = list(range(10 ** (digits - 1), 10 ** digits))
    random.Random(seed).shuffle(numbers)

    def row(n: int) -> dict[str, Any]:
        answer = str(n)[::-1]
        return {"id": f"rev-{n}", "prompt": f"rev {n}=", "answer": answer,
                "reward_args": {}, "truth": {"type": "short", "answer": answer}}

    rows = [row(n) for n in numbers]
    return rows[heldout:], rows[:heldout]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def corrupt(answer: str, rng: random.Random) -> str:
    """The answer with one digit replaced by a different one: a plausible wrong demonstration."""
    i = rng.randrange(len(answer))
    wrong = rng.choice([d for d in "0123456789" if d != answer[i]])
    return answer[:i] + wrong + answer[i + 1:]


def warm_start(model_dir: Path, out_dir: Path, rows: list[dict], *, steps: int, lr: float = 3e-3,
               batch: int = 32, seed: int = 0, noise: float = 0.0) -> float:
    """Supervised fine-tuning on prompt -> answer, where a `noise` share of the demonstrations
    carry one wrong digit (imperfect data); returns the last loss."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from tandem.weights.hf import load_tokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        chosen = rng.sample(rows, batch)
        prompts = [tok(r["prompt"], add_special_tokens=False).input_ids for r in chosen]
        shown = [corrupt(r["answer"], rng) if rng.random() < noise else r["answer"]
                 for r in chosen]
        answers = [tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id] for a in shown]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers))
        ids = torch.full((batch, width), tok.pad_token_id)
        mask = torch.zeros(batch, width)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            mask[i, len(p):len(p) + len(a)] = 1
        logits = model(input_ids=ids).logits[:, :-1]
        token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                     reduction="none")
        loss = (token_loss * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return float(loss.detach())


def prepare(root: Path, *, seed: int = 0, sft_steps: int = 80,
            say: Callable[[str], None] = lambda _: None) -> tuple[int, float]:
    """The quickstart's first two steps under `root`: `data/train.jsonl` and
    `data/heldout.jsonl`, `model-init` (a tiny Qwen2 and a character tokenizer) and `model-sft`
    (it after `sft_steps` of SFT); `say` hears what is being done. Returns the model's parameter
    count and the last SFT loss.
    The benchmarks that start from the quickstart's model call it too."""
    from tandem.weights.tiny import build_tiny_model

    train, heldout = reversal_tasks(seed)
    write_jsonl(train, root / "data" / "train.jsonl")
    write_jsonl(heldout, root / "data" / "heldout.jsonl")
    say(f"1/4 building a tiny Qwen2 and a character tokenizer in {root / 'model-init'}")
    model, _ = build_tiny_model(root / "model-init", seed=seed, **MODEL)
    params = sum(p.numel() for p in model.parameters())
    say(f"    {params / 1e6:.2f}M parameters; task: reverse the digits "
        f"({len(train)} training prompts, {len(heldout)} held out)")
    say(f"2/4 SFT warm start, {sft_steps} steps")
    loss = warm_start(root / "model-init", root / "model-sft", train, steps=sft_steps, seed=seed)
    say(f"    loss {loss:.3f}")
    return params, loss


def before_after(run_dir: Path) -> tuple[dict, dict]:
    """The first and the last evaluation of the held-out taskset in run_dir/eval.jsonl."""
    path = run_dir / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    rows = [r for r in rows if r.get("taskset") == "heldout"]
    if len(rows) < 2:
        raise click.ClickException(f"{path}: expected the evaluations before and after GRPO, "
                                   f"found {len(rows)}")
    return rows[0], rows[-1]


def quickstart_config(run_dir: Path, model_dir: Path, taskset: Path, *, preset: str,
                      steps: int, seed: int, explorers: int = 1, lr: float = 3e-4,
                      heldout: Path | None = None, device: str = "cpu",
                      colocate: bool = False, reward_fn: str = "k12",
                      max_tokens: int = 6) -> RunConfig:
    """The GRPO run: the same settings the examples/ configs spell out, plus the held-out
    evaluation (before the first step and at the end) when `heldout` is set; `device` is the
    trainer's and every explorer engine's (cpu, cuda); `colocate`: the explorer time-shares the
    trainer's devices, waking to each version from shared memory (placement.colocate);
    `reward_fn` grades the tasks' `truth` (k12; vision for --vision's counts)."""
    names = [f"explorer-{i}" for i in range(explorers)]
    colocated = ({"placement": {"colocate": ["trainer", names[0]]},
                  "weights": {"transport": "shared_memory", "keep_versions": 1}}
                 if colocate else {})
    return RunConfig.model_validate({
        "name": "quickstart", "run_dir": str(run_dir), "seed": seed,
        "model": {"path": str(model_dir)},
        "sync": {"preset": preset, "timeout": 120,
                 **({"method": "checkpoint"} if colocate else {})},
        **colocated,
        "master": {"total_steps": steps,
                   "taskset": {"path": str(taskset), "seed": seed, "epochs": 100}},
        "explorers": [{"name": n, "batch_size": 16 // explorers, "repeat_times": 8,
                       "workflow": "single_turn", "engine": {"device": device},
                       "workflow_args": {"reward_fn": reward_fn, "answer_key": "truth"},
                       "sampling": {"temperature": 1.0, "max_tokens": max_tokens}}
                      for n in names],
        "trainer": {"groups_per_step": 16, "lr": lr, "advantage": "grpo", "loss": "ppo_clip",
                    "checkpoint_every": 0, "device": device},
        "reward": {"functions": {reward_fn: 1.0}},
        "logging": {"level": "warning"},
        "eval": {"tasksets": [{"name": "heldout", "path": str(heldout)}] if heldout else [],
                 "every": 0, "repeat_times": 4, "seed": seed},
    })


@click.command("quickstart")
@click.option("--run-dir", default="runs/quickstart", show_default=True, type=click.Path())
@click.option("--preset", default="synchronous", show_default=True,
              type=click.Choice(list(PRESETS)))
@click.option("--steps", type=int, default=None,
              help="GRPO trainer steps [default: 150; 30 with --vision]")
@click.option("--sft-steps", type=int, default=None,
              help="warm-start SFT steps [default: 80; 150 with --vision]")
@click.option("--lr", default=3e-4, show_default=True, help="GRPO learning rate")
@click.option("--seed", default=0, show_default=True)
@click.option("--plain", is_flag=True, help="progress lines instead of a live panel")
@click.option("--device", default="cpu", show_default=True,
              help="the trainer's and the explorers' device (cuda: the GRPO run on a GPU)")
@click.option("--colocate", is_flag=True,
              help="the explorer time-shares the trainer's devices, asleep while it trains "
                   "(placement.colocate; --preset synchronous)")
@click.option("--vision", is_flag=True,
              help="a tiny vision-language model learns to count circles in images "
                   "(docs/vision.md)")
def quickstart(run_dir: str, preset: str, steps: int | None, sft_steps: int | None, lr: float,
               seed: int, plain: bool, device: str, colocate: bool, vision: bool) -> None:
    """Run a tiny end-to-end example on CPU (or --device cuda): SFT warm start, then GRPO,
    reward rising."""
    import shutil

    if colocate and preset != "synchronous":
        raise click.UsageError(f"--colocate needs --preset synchronous (rollout and training "
                               f"alternate), not {preset}")

    from .up import run_up

    root = Path(run_dir)
    if root.exists():
        shutil.rmtree(root)
    started = time.monotonic()
    if vision:
        from .vision_quickstart import prepare_vision

        sft_steps = 150 if sft_steps is None else sft_steps
        steps = 30 if steps is None else steps
        params, _ = prepare_vision(root, seed=seed, sft_steps=sft_steps, say=click.echo)
    else:
        sft_steps = 80 if sft_steps is None else sft_steps
        steps = 150 if steps is None else steps
        params, _ = prepare(root, seed=seed, sft_steps=sft_steps, say=click.echo)
    taskset, heldout_set = root / "data" / "train.jsonl", root / "data" / "heldout.jsonl"
    click.echo(f"3/4 GRPO through the full system ({preset}, {steps} trainer steps)")
    config = quickstart_config(root / "grpo", root / "model-sft", taskset, preset=preset,
                               steps=steps, seed=seed, lr=lr, heldout=heldout_set,
                               explorers=preset_explorers(preset), device=device,
                               colocate=colocate, reward_fn="vision" if vision else "k12",
                               max_tokens=3 if vision else 6)
    code = run_up(config, live=False if plain else None, prog="tandem quickstart")
    if code != 0:
        sys.exit(code)
    first, last = before_after(root / "grpo")
    click.echo(f"4/4 held-out accuracy (the run's evaluation, version {first['version']} -> "
               f"{last['version']}; run_dir/eval.jsonl)")
    before, after = {}, {}
    for name, key in (("sampled (temperature 1)", "sampled/accuracy"),
                      ("sampled pass@4", "sampled/pass@4"), ("greedy", "greedy/accuracy")):
        b, a = first["metrics"][key], last["metrics"][key]
        before[key], after[key] = b, a
        click.echo(f"    {name + ':':<25}{b:.2f} -> {a:.2f} ({a - b:+.2f})")
    click.echo(f"    total {time.monotonic() - started:.0f} s; run dir {root}")
    (root / "result.json").write_text(json.dumps(
        {"before": before, "after": after, "versions": [first["version"], last["version"]],
         "seconds": time.monotonic() - started, "preset": preset, "colocate": colocate,
         "steps": steps, "vision": vision,
         "sft_steps": sft_steps, "params": params}, indent=2))
