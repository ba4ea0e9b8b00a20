"""The quickstart task (reverse three digits) trained three ways through `tandem up`, side by side:
full fine-tuning, LoRA (`model.lora`), and LoRA with dynamic sampling (`trainer.dynamic_sampling`).

    .venv/bin/python tools/quickstart_variants.py [--steps 60] [--variants full,lora,lora_dyn]
        [--out .bench/quickstart_variants.json]

One tiny Qwen2 and one SFT warm start (as `tandem quickstart` builds them) feed every variant;
each is the quickstart's synchronous GRPO config with the held-out evaluation before the first
step and at the end. Reported per variant: held-out accuracy (greedy and sampled) before and
after, wall seconds, the checkpoint's bytes (model or adapter, and optimiser state), and from
the trainer's trace the groups dynamic sampling discarded and the top-up batches the master
added. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

LORA = {"r": 8, "alpha": 16.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_variant(root: Path, name: str, steps: int, seed: int) -> dict:
    from tandem.common.config import RunConfig
    from tandem.common.trace import read_trace
    from tandem.master.quickstart import before_after, quickstart_config
    from tandem.master.up import run_up

    data = root / "data"
    config = quickstart_config(root / name, root / "model-sft", data / "train.jsonl",
                               preset="synchronous", steps=steps, seed=seed,
                               heldout=data / "heldout.jsonl").model_dump()
    if name.startswith("lora"):
        config["model"]["lora"] = LORA
        config["trainer"]["lr"] = 3e-3  # adapters start at zero and want a larger step
    if name.endswith("dyn"):
        config["trainer"].update(dynamic_sampling=True, max_oversample=2)
    config["eval"]["every"] = steps  # before the first step and at the end
    start = time.monotonic()
    code = run_up(RunConfig.model_validate(config), live=False, prog="quickstart_variants")
    seconds = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"{name}: tandem up exited {code}; see {root / name}")
    first, last = before_after(root / name)
    ckpt = max((root / name / "checkpoints").glob("step_*"))
    spans = [s for s in read_trace(root / name) if s["kind"] == "train"]
    return {
        "variant": name, "steps": len(spans), "seconds": round(seconds, 1),
        "greedy": [first["metrics"]["greedy/accuracy"], last["metrics"]["greedy/accuracy"]],
        "sampled": [first["metrics"]["sampled/accuracy"], last["metrics"]["sampled/accuracy"]],
        "weights_bytes": folder_bytes(ckpt / "adapter") or folder_bytes(ckpt / "model"),
        "optimizer_bytes": (ckpt / "optimizer.pt").stat().st_size,
        "discarded_groups": sum(s["attrs"].get("discarded_groups", 0) for s in spans),
        "extra_batches": sum(s["attrs"].get("extra_batches", 0) for s in spans),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--variants", default="full,lora,lora_dyn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=".bench/quickstart_variants")
    parser.add_argument("--out", default=".bench/quickstart_variants.json")
    args = parser.parse_args()

    import shutil

    from tandem.master.quickstart import prepare

    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    prepare(root, seed=args.seed)
    rows = [run_variant(root, name, args.steps, args.seed) for name in args.variants.split(",")]

    print(f"\nquickstart task, {args.steps} synchronous GRPO steps after an 80-step SFT warm start")
    print("| variant | held-out greedy | held-out sampled | seconds | checkpoint weights | "
          "optimiser state | discarded groups | top-up batches |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['greedy'][0]:.2f} -> {r['greedy'][1]:.2f} | "
              f"{r['sampled'][0]:.2f} -> {r['sampled'][1]:.2f} | {r['seconds']:.0f} | "
              f"{r['weights_bytes'] / 1e3:.0f} kB | {r['optimizer_bytes'] / 1e3:.0f} kB | "
              f"{r['discarded_groups']} | {r['extra_batches']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "seed": args.seed, "rows": rows}, indent=2))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
