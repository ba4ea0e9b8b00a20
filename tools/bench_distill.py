"""On-policy distillation against GRPO alone on the quickstart task (reverse three digits), side
by side in one invocation: the same student, the same steps, through `tandem up`.

    .venv/bin/python tools/bench_distill.py [--steps 40] [--teacher-sft-steps 300]
        [--variants grpo,distill,distill_task] [--lr 3e-4] [--out .bench/distill.json] [--reuse]

One tiny Qwen2 (`tandem quickstart`'s MODEL) and two supervised warm starts from it: the
student, the quickstart's deliberately short 80 SFT steps, and the teacher, the same SFT run
for `--teacher-sft-steps` steps (a stronger checkpoint of the same model and tokenizer). Each
variant is the quickstart's synchronous GRPO config from the student with the held-out
evaluation (100 prompts) before the first step and at the end, and the teacher in the trainer
(`trainer.teacher`); they differ in the advantage only:

- grpo: `advantage: grpo`; the teacher only measures the reverse KL, the update is GRPO's;
- distill: `advantage: distill`, the teacher alone (teacher - student logprob per token);
- distill_task: `advantage: distill` with `teacher.task_weight: 1` (plus GRPO's advantage).

Reported per variant: held-out greedy and sampled accuracy before and after, the reverse KL
to the teacher (`teacher/reverse_kl` from the trace's `train` spans, the mean of the first and
of the last five steps) and wall seconds; the teacher's own held-out greedy accuracy for scale.
Prints a table, writes JSON. `--reuse` keeps the models of an earlier invocation under `--root`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

VARIANTS = {
    "grpo": {"advantage": "grpo"},
    "distill": {"advantage": "distill"},
    "distill_task": {"advantage": "distill", "task_weight": 1.0},
}


def greedy_accuracy(model_dir: Path, rows: list[dict], max_tokens: int = 6) -> float:
    """Held-out greedy accuracy of a model folder, by the quickstart's `k12` check."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.common.config import RewardConfig
    from tandem.common.messages.reward import ScoreItem
    from tandem.reward.functions.k12 import K12Reward
    from tandem.weights.hf import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    check, right = K12Reward(RewardConfig()), 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([tok(r["prompt"], add_special_tokens=False).input_ids])
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            right += check.score(ScoreItem(response=text, truth=r["truth"])).score > 0
    return right / len(rows)


def run(root: Path, name: str, steps: int, seed: int, lr: float) -> dict:
    from tandem.common.config import RunConfig
    from tandem.common.trace import read_trace
    from tandem.master.quickstart import before_after, quickstart_config
    from tandem.master.up import run_up

    data = root / "data"
    config = quickstart_config(root / name, root / "model-sft", data / "train.jsonl",
                               preset="synchronous", steps=steps, seed=seed, lr=lr,
                               heldout=data / "heldout.jsonl").model_dump()
    variant = dict(VARIANTS[name])
    config["trainer"]["advantage"] = variant.pop("advantage")
    config["trainer"]["teacher"] = {"path": str(root / "model-teacher"), **variant}
    config["eval"]["every"] = steps  # before the first step and at the end
    start = time.monotonic()
    code = run_up(RunConfig.model_validate(config), live=False, prog="bench_distill")
    seconds = time.monotonic() - start
    spans = sorted((s for s in read_trace(root / name) if s["kind"] == "train"),
                   key=lambda s: s["step"])
    if code != 0 and len(spans) < steps:
        raise SystemExit(f"{name}: tandem up exited {code} after {len(spans)} of {steps} steps; "
                         f"see {root / name}")
    first, last = before_after(root / name)
    kl = [s["attrs"]["teacher_reverse_kl"] for s in spans]
    return {
        "variant": name, "advantage": config["trainer"]["advantage"],
        "teacher": config["trainer"]["teacher"], "steps": len(spans), "exit_code": code,
        "seconds": round(seconds, 1),
        "greedy": [first["metrics"]["greedy/accuracy"], last["metrics"]["greedy/accuracy"]],
        "sampled": [first["metrics"]["sampled/accuracy"], last["metrics"]["sampled/accuracy"]],
        "versions": [first["version"], last["version"]],
        # one step's batch is noisy: the mean of the first and of the last five steps
        "reverse_kl": [statistics.fmean(kl[:5]), statistics.fmean(kl[-5:])],
        "reverse_kl_per_step": kl,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--teacher-sft-steps", type=int, default=300)
    parser.add_argument("--variants", default="grpo,distill,distill_task")
    parser.add_argument("--lr", type=float, default=3e-4, help="every variant's (quickstart's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=".bench/distill")
    parser.add_argument("--out", default=".bench/distill.json")
    parser.add_argument("--reuse", action="store_true",
                        help="keep an earlier invocation's model, student and teacher")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")

    import shutil

    from tandem.master.quickstart import prepare, reversal_tasks, warm_start

    root = Path(args.root)
    train, heldout = reversal_tasks(args.seed)
    if args.reuse and (root / "model-teacher").exists():
        for name in VARIANTS:
            shutil.rmtree(root / name, ignore_errors=True)
    else:
        shutil.rmtree(root, ignore_errors=True)
        prepare(root, seed=args.seed)
        warm_start(root / "model-init", root / "model-teacher", train,
                   steps=args.teacher_sft_steps, seed=args.seed)
    teacher_greedy = greedy_accuracy(root / "model-teacher", heldout)
    rows = [run(root, name, args.steps, args.seed, args.lr) for name in names]

    print(f"\nquickstart task, {args.steps} synchronous steps at lr {args.lr:g} from the 80-step "
          "SFT student; "
          f"teacher: {args.teacher_sft_steps} SFT steps (held-out greedy {teacher_greedy:.2f})")
    print("| variant | held-out greedy | held-out sampled | reverse KL to teacher (first 5 -> "
          "last 5 steps) | seconds |")
    print("|---|---|---|---|---|")
    for r in rows:
        g, s, kl = r["greedy"], r["sampled"], r["reverse_kl"]
        print(f"| {r['variant']} | {g[0]:.2f} -> {g[1]:.2f} | {s[0]:.2f} -> {s[1]:.2f} | "
              f"{kl[0]:.3f} -> {kl[1]:.3f} | {r['seconds']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "seed": args.seed, "lr": args.lr,
                               "teacher_sft_steps": args.teacher_sft_steps,
                               "teacher_greedy": teacher_greedy, "rows": rows}, indent=2))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
