"""The time a `tandem up` invocation spends outside its run (issue 16 item 6), for two installs
side by side: typically the tree before a change and the tree after it.

    .venv/bin/python tools/bench_startup.py --tandem before=/old/.venv/bin/tandem \
        --tandem after=.venv/bin/tandem [--preset fully_async] [--steps 10] [--rounds 2]
        [--out .bench/startup.json]

Each round runs every install once, interleaved (the machine is shared and noisy), on the same
config: the quickstart task, one explorer, a tiny Qwen2 built locally, `placement: auto`. From
each summary it reads the run's wall-clock (the trace's), every component's start-up seconds
(process start to registered), the invocation end to end and the time outside the run; the
shell's own time for the command is measured too. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def write_config(workdir: Path, model_dir: Path, *, preset: str, steps: int) -> Path:
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(0)
    config = {
        "name": f"startup-{preset}", "run_dir": str(workdir / "run"), "seed": 0,
        "model": {"path": str(model_dir)},
        "sync": {"preset": preset, "timeout": 120},
        "master": {"total_steps": steps, "taskset": {
            "path": str(write_jsonl(train[:256], workdir / "train.jsonl")), "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": 8, "repeat_times": 4,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 6}}],
        "trainer": {"groups_per_step": 8, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": 60.0},
        "logging": {"level": "warning"},
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def parse_summary(text: str) -> dict:
    """The summary rows `tandem up` prints at the end, as numbers."""
    rows = dict(re.findall(r"^\s*([a-z][a-z /-]+?): (.*)$", text, flags=re.MULTILINE))
    seconds = lambda s: float(s.split()[0])
    out = {"result": rows.get("result", "?")}
    for key in ("wall-clock", "end to end", "outside the run"):
        if key in rows:
            out[key.replace(" ", "_").replace("-", "_")] = seconds(rows[key])
    if "start-up seconds" in rows:
        out["startup"] = {name: float(value) for name, value in
                          re.findall(r"([\w-]+) ([\d.]+)", rows["start-up seconds"])}
    return out


def median(rows: list[dict], key: str, name: str | None = None) -> float:
    values = [r[key] if name is None else r[key].get(name) for r in rows]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def run_once(tandem: str, config: Path, run_dir: Path) -> dict:
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    start = time.monotonic()
    proc = subprocess.Popen([tandem, "up", str(config), "--plain"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # the whole run, its components included
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {"result": "timed out after 300 s", "code": -1,
                "invocation": time.monotonic() - start}
    row = parse_summary(out)
    row["invocation"] = time.monotonic() - start
    row["code"] = proc.returncode
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tandem", action="append", required=True, metavar="LABEL=PATH",
                        help="an install's tandem executable, labelled (repeatable)")
    parser.add_argument("--preset", default="fully_async")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=".bench/startup.json")
    args = parser.parse_args()
    installs = dict(item.split("=", 1) for item in args.tandem)

    from tandem.weights.tiny import build_tiny_model

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        build_tiny_model(model_dir)
        config = write_config(workdir, model_dir, preset=args.preset, steps=args.steps)
        for rnd in range(args.rounds):
            for label, tandem in installs.items():
                row = run_once(tandem, config, workdir / "run")
                row.update(label=label, round=rnd, load=os.getloadavg()[0])
                rows.append(row)
                print(f"round {rnd} {label}: {json.dumps(row)}", file=sys.stderr, flush=True)

    print(f"\n{args.preset}, {args.steps} steps, {args.rounds} rounds interleaved (medians)\n")
    header = "| install | wall-clock | trainer start-up | explorer start-up | end to end | " \
             "outside the run | invocation | load |"
    print(header)
    print("|---" * 8 + "|")
    summary = {}
    for label in installs:
        mine = [r for r in rows if r["label"] == label and r["code"] == 0]
        s = summary[label] = {
            "runs_ok": len(mine), "wall_clock": median(mine, "wall_clock"),
            "trainer_startup": median(mine, "startup", "trainer"),
            "explorer_startup": median(mine, "startup", "explorer-0"),
            "end_to_end": median(mine, "end_to_end"),
            "outside_the_run": median(mine, "outside_the_run"),
            "invocation": median(mine, "invocation"), "load": median(mine, "load")}
        print(f"| {label} | {s['wall_clock']:.1f} s | {s['trainer_startup']:.1f} s | "
              f"{s['explorer_startup']:.1f} s | {s['end_to_end']:.1f} s | "
              f"{s['outside_the_run']:.1f} s | {s['invocation']:.1f} s | {s['load']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "steps": args.steps, "rows": rows,
                               "summary": summary}, indent=2))
    print(f"\nwrote {out}")
    return 0 if all(r["code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
