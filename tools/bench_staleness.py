"""The quickstart task under `fully_async` with a fixed staleness bound and with
`sync.max_staleness: auto`, side by side (issue 28 item 5, docs/sync.md).

    .venv/bin/python tools/bench_staleness.py [--steps 30] [--bounds 0,1,4,8,auto]
        [--set sync.auto.target.below=0.02 ...] [--out .bench/staleness.json]

One tiny Qwen2 and one SFT warm start (as `tandem quickstart` builds them) feed every run; each
is the quickstart's config (examples/fully_async.yaml: 16 tasks x 8 samples a step, one
explorer) for the same number of trainer steps, with the held-out evaluation before the first
step and at the end, `sync.max_staleness` set per run and `--set` overrides on top (the `auto`
knobs, say). Reported per run: wall seconds of `tandem up` (start-up included, the same for
every run) and of the training itself (first train step's start to the last one's end, from the
trace), trainer steps per training second, held-out accuracy (greedy and sampled) before and
after, the staleness the rollouts had (explorer step - weight version: mean and max), the mean
`mismatch/kl` the trainer measured, and for `auto` the bounds the master set (its journal).
Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def run_one(root: Path, bound: str, steps: int, seed: int, overrides: list[str]) -> dict:
    from tandem.common.config import RunConfig
    from tandem.common.config.loader import apply_override
    from tandem.common.messages import StalenessSet
    from tandem.common.trace import read_trace
    from tandem.master.journal import read_journal
    from tandem.master.quickstart import before_after, quickstart_config
    from tandem.master.up import run_up

    data, run_dir = root / "data", root / f"staleness-{bound}"
    config = quickstart_config(run_dir, root / "model-sft", data / "train.jsonl",
                               preset="fully_async", steps=steps, seed=seed,
                               heldout=data / "heldout.jsonl").model_dump()
    config["sync"]["max_staleness"] = bound if bound == "auto" else int(bound)
    config["eval"]["every"] = steps  # before the first step and at the end
    config["up"]["timeline"] = False
    for assignment in overrides:
        apply_override(config, assignment)
    start = time.monotonic()
    code = run_up(RunConfig.model_validate(config), live=False, prog="bench_staleness")
    seconds = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"max_staleness {bound}: tandem up exited {code}; see {run_dir}")
    first, last = before_after(run_dir)
    spans = read_trace(run_dir)
    trains = sorted((s for s in spans if s["kind"] == "train"), key=lambda s: s["start"])
    training = trains[-1]["end"] - trains[0]["start"]
    stale = [s["step"] - s["version"] for s in spans
             if s["kind"] == "rollout" and s.get("version") is not None]
    kl = [s["attrs"]["mismatch_kl"] for s in trains if "mismatch_kl" in (s.get("attrs") or {})]
    bounds = [(r.step, r.bound) for r in read_journal(run_dir / "master" / "journal.bin")
              if isinstance(r, StalenessSet)]
    return {
        "max_staleness": bound, "steps": len(trains), "seconds": round(seconds, 1),
        "training_seconds": round(training, 1),
        "steps_per_s": round((len(trains) - 1) / training, 3) if training > 0 else None,
        "greedy": [first["metrics"]["greedy/accuracy"], last["metrics"]["greedy/accuracy"]],
        "sampled": [first["metrics"]["sampled/accuracy"], last["metrics"]["sampled/accuracy"]],
        "staleness_mean": round(sum(stale) / len(stale), 2) if stale else None,
        "staleness_max": max(stale, default=None),
        "mismatch_kl_mean": round(sum(kl) / len(kl), 6) if kl else None,
        "bounds_set": bounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bounds", default="0,1,4,8,auto",
                        help="sync.max_staleness of each run: numbers and/or auto")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override for every run (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=".bench/staleness")
    parser.add_argument("--out", default=".bench/staleness.json")
    args = parser.parse_args()

    from tandem.master.quickstart import prepare

    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    prepare(root, seed=args.seed)
    rows = [run_one(root, bound, args.steps, args.seed, args.overrides)
            for bound in args.bounds.split(",")]

    fastest = max((r for r in rows if r["max_staleness"] != "auto" and r["steps_per_s"]),
                  key=lambda r: r["steps_per_s"], default=None)
    sync = next((r for r in rows if r["max_staleness"] == "0"), None)
    print(f"\nquickstart task, fully_async, {args.steps} trainer steps after an 80-step SFT warm "
          f"start, seed {args.seed}" + (f", --set {' '.join(args.overrides)}"
                                        if args.overrides else ""))
    print("| max_staleness | wall s | training s | steps/s | vs fastest fixed | held-out greedy "
          "| held-out sampled | staleness mean/max | mismatch/kl mean | bounds set (step: bound) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = (f"{r['steps_per_s'] / fastest['steps_per_s']:.0%}"
                 if fastest and r["steps_per_s"] else "-")
        bounds = ", ".join(f"{s}: {b}" for s, b in r["bounds_set"]) or "-"
        print(f"| {r['max_staleness']} | {r['seconds']:.0f} | {r['training_seconds']:.0f} | "
              f"{r['steps_per_s']} | {share} | {r['greedy'][0]:.3f} -> {r['greedy'][1]:.3f} | "
              f"{r['sampled'][0]:.3f} -> {r['sampled'][1]:.3f} | {r['staleness_mean']} / "
              f"{r['staleness_max']} | {r['mismatch_kl_mean']} | {bounds} |")
    if sync is not None:
        print(f"synchronous reference (max_staleness 0): held-out greedy {sync['greedy'][1]:.3f},"
              f" sampled {sync['sampled'][1]:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "seed": args.seed,
                               "overrides": args.overrides, "rows": rows}, indent=2))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
