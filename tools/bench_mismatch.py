"""The trainer/engine mismatch of a top-p sampler, without and with `trainer.sampler_truncation`:
the quickstart task (reverse three digits) sampled at `top_p: 0.9`, trained through `tandem up`
twice from the same seed, once with the trainer's logprobs under the full softmax and once under
the sampler's own top-p support.

    .venv/bin/python tools/bench_mismatch.py [--steps 20] [--top-p 0.9]
        [--out .bench/mismatch.json] [--reuse]

One tiny Qwen2 and one SFT warm start (as `tandem quickstart` builds them) feed both runs, the
quickstart's synchronous GRPO config with `off_policy.proximal` (the mismatch is measured on the
proximal pass, before each update). Reported per run, from the trainer's trace: `mismatch/kl`
(the k3 estimate of KL(behaviour || trainer) over the action tokens) mean and max over the
steps, the mean and the largest trainer/behaviour ratio, and wall seconds. Prints a table,
writes JSON. `--reuse` keeps the model and warm start of an earlier invocation under `--root`.
A run whose `tandem up` exits non-zero is reported (`exit_code`) when its trace holds every
step, and is an error otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def run(root: Path, name: str, steps: int, seed: int, top_p: float, truncate: bool) -> dict:
    from tandem.common.config import RunConfig
    from tandem.common.trace import read_trace
    from tandem.master.quickstart import quickstart_config
    from tandem.master.up import run_up

    config = quickstart_config(root / name, root / "model-sft", root / "data" / "train.jsonl",
                               preset="synchronous", steps=steps, seed=seed).model_dump()
    config["explorers"][0]["sampling"]["top_p"] = top_p
    config["trainer"].update(off_policy={"proximal": True}, sampler_truncation=truncate)
    start = time.monotonic()
    code = run_up(RunConfig.model_validate(config), live=False, prog="bench_mismatch")
    seconds = time.monotonic() - start
    spans = sorted((s for s in read_trace(root / name) if s["kind"] == "train"),
                   key=lambda s: s["step"])
    if code != 0 and len(spans) < steps:
        raise SystemExit(f"{name}: tandem up exited {code} after {len(spans)} of {steps} steps; "
                         f"see {root / name}")
    attrs = [s["attrs"] for s in spans]
    kl = [a["mismatch_kl"] for a in attrs]
    return {
        "run": name, "sampler_truncation": truncate, "steps": len(spans), "exit_code": code,
        "seconds": round(seconds, 1),
        "kl_mean": statistics.fmean(kl), "kl_max": max(kl),
        "ratio_mean": statistics.fmean(a["mismatch_ratio_mean"] for a in attrs),
        "ratio_max": max(a["mismatch_ratio_max"] for a in attrs),
        "kl_per_step": kl,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=".bench/mismatch")
    parser.add_argument("--out", default=".bench/mismatch.json")
    parser.add_argument("--reuse", action="store_true",
                        help="keep an earlier invocation's model and warm start")
    args = parser.parse_args()

    import shutil

    from tandem.master.quickstart import prepare

    root = Path(args.root)
    if args.reuse and (root / "model-sft").exists():
        for name in ("full_softmax", "sampler_truncation"):
            shutil.rmtree(root / name, ignore_errors=True)
    else:
        shutil.rmtree(root, ignore_errors=True)
        prepare(root, seed=args.seed)
    rows = [run(root, name, args.steps, args.seed, args.top_p, truncate)
            for name, truncate in (("full_softmax", False), ("sampler_truncation", True))]

    print(f"\nquickstart task at top_p {args.top_p}, {args.steps} synchronous GRPO steps after "
          "an 80-step SFT warm start; mismatch measured on the proximal pass of each step")
    print("| trainer logprobs | mismatch/kl mean | mismatch/kl max | ratio mean | ratio max | "
          "seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['ratio_mean']:.4f} | "
              f"{r['ratio_max']:.3f} | {r['seconds']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "top_p": args.top_p, "seed": args.seed,
                               "rows": rows}, indent=2))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
