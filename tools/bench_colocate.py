"""Peak memory of a colocated run (`placement.colocate`) against the same run with separate
copies (issue 29 item 2).

    .venv/bin/python tools/bench_colocate.py [--hidden 512 --layers 8] [--steps 6]
        [--rounds 1] [--interval 0.1] [--out .bench/bench_colocate.json]

Each run is one `tandem up` of the quickstart task on a random Qwen2 built locally from a config
(`--hidden`, `--layers`: 25M parameters, 95 MiB in float32, by default), `sync.preset:
synchronous` with `sync.method: checkpoint` and `weights.transport: shared_memory`, one explorer,
`weights.keep_versions: 1`; the two modes differ only in `placement.colocate: [trainer,
explorer-0]`. While it runs, this tool reads the proportional set size (PSS: shared pages split
between the processes sharing them, so the sum is what the tree holds) of `tandem up` and every
process under it, every `--interval` seconds, less their mappings of the run's /dev/shm
segments, and the bytes of those segments, counted once whether mapped or not. After the run,
each sample is put in the phase the trace says it was taken in, when it lies wholly inside one
of the trainer's `train` spans or the explorer's `rollout` spans. Columns:

- peak tree memory: the largest (tree PSS + segment bytes) of any sample, and of the samples
  taken while the trainer trains;
- explorer in training / rolling out: the explorer process's median PSS over the samples inside
  `train` / `rollout` spans (asleep, colocated: the interpreter, torch and the tokenizer, no
  weights);
- trainer step s: the median `train` span, to show what sleeping and waking costs (the `wake`
  and `sleep` spans' medians are given too).

Sampling is a poll, so a peak shorter than the interval can be missed; both modes are sampled
the same way. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

TANDEM = str(Path(sys.executable).parent / "tandem")
MiB = 2**20


def build_model(path: Path, hidden: int, layers: int) -> Path:
    from tandem.weights.tiny import build_tiny_model

    if not (path / "config.json").is_file():
        build_tiny_model(path, hidden=hidden, layers=layers, heads=max(1, hidden // 64),
                         kv_heads=max(1, hidden // 128), intermediate=hidden * 11 // 4)
    return path


def write_config(workdir: Path, model_dir: Path, *, colocate: bool, steps: int) -> Path:
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(0)
    mode = "colocated" if colocate else "separate"
    config = {
        "name": f"bench-{mode}", "run_dir": str(workdir / mode), "seed": 0,
        "model": {"path": str(model_dir)},
        "sync": {"preset": "synchronous", "method": "checkpoint", "timeout": 120},
        "weights": {"transport": "shared_memory", "keep_versions": 1},
        "placement": {"colocate": ["trainer", "explorer-0"] if colocate else []},
        "master": {"total_steps": steps, "taskset": {
            "path": str(write_jsonl(train[:64], workdir / "train.jsonl")), "epochs": 100}},
        "explorers": [{"name": "explorer-0", "batch_size": 4, "repeat_times": 4,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 8}}],
        "trainer": {"groups_per_step": 4, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}},
        "logging": {"level": "warning"},
        "up": {"timeline": False, "run_timeout": 600},
    }
    path = workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def role(proc: psutil.Process) -> str:
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    for name in ("explorer", "trainer", "buffer", "reward", "master"):
        if name in line and " up " not in f" {line} ":
            return name
    return "up" if " up " in f" {line} " else "other"


def pss(proc: psutil.Process) -> int:
    """The process's PSS less its mappings of weight segments, which `shm_bytes` counts once
    (mapped or not)."""
    try:
        return sum(m.pss for m in proc.memory_maps(grouped=True)
                   if not m.path.startswith("/dev/shm/tandem-"))
    except psutil.Error:
        return 0


def shm_bytes(run_dir: Path) -> int:
    from tandem.weights.shm import SHM_ROOT, run_key

    prefix = f"tandem-{run_key(run_dir)}-"
    total = 0
    for entry in SHM_ROOT.iterdir():
        if entry.name.startswith(prefix):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


def sample(root: psutil.Process, run_dir: Path, interval: float, out: list, done: threading.Event
           ) -> None:
    while not done.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        start = time.time()
        by_role: dict[str, int] = {}
        for p in procs:
            r = role(p)
            by_role[r] = by_role.get(r, 0) + pss(p)
        out.append({"t0": start, "t": time.time(), "pss": by_role, "shm": shm_bytes(run_dir)})
        done.wait(interval)


def one_run(workdir: Path, model_dir: Path, *, colocate: bool, steps: int, interval: float
            ) -> dict[str, Any]:
    from tandem.common.trace import read_trace

    config = write_config(workdir, model_dir, colocate=colocate, steps=steps)
    run_dir = Path(yaml.safe_load(config.read_text())["run_dir"])
    samples: list[dict[str, Any]] = []
    done = threading.Event()
    started = time.monotonic()
    proc = subprocess.Popen([TANDEM, "up", str(config), "--plain"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sampler = threading.Thread(target=sample, args=(psutil.Process(proc.pid), run_dir, interval,
                                                    samples, done))
    sampler.start()
    try:
        output, _ = proc.communicate(timeout=900)
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(f"tandem up {config} exited {proc.returncode}:\n{output[-3000:]}")
    spans = read_trace(run_dir)
    trains = [(s["start"], s["end"]) for s in spans if s["kind"] == "train"]
    rollouts = [(s["start"], s["end"]) for s in spans if s["kind"] == "rollout"]

    def within(s: dict[str, Any], spans: list[tuple[float, float]]) -> bool:
        # the whole sample (its processes are read one after another) inside one span
        return any(a <= s["t0"] and s["t"] <= b for a, b in spans)

    def total(s: dict[str, Any]) -> int:
        return sum(s["pss"].values()) + s["shm"]

    peak = max(samples, key=total)
    peak_train = max((s for s in samples if within(s, trains)), key=total, default=None)
    explorer_train = [s["pss"].get("explorer", 0) for s in samples if within(s, trains)]
    explorer_rollout = [s["pss"].get("explorer", 0) for s in samples if within(s, rollouts)]

    def median_span(kind: str) -> float | None:
        d = [s["end"] - s["start"] for s in spans if s["kind"] == kind]
        return round(statistics.median(d), 4) if d else None

    return {
        "mode": "colocated" if colocate else "separate", "steps": steps,
        "seconds": round(time.monotonic() - started, 1), "samples": len(samples),
        "peak_total_mib": round(total(peak) / MiB, 1),
        "peak_by_role_mib": {k: round(v / MiB, 1) for k, v in peak["pss"].items()},
        "peak_shm_mib": round(peak["shm"] / MiB, 1),
        "peak_in_training_mib": (round(total(peak_train) / MiB, 1) if peak_train else None),
        "explorer_train_mib": (round(statistics.median(explorer_train) / MiB, 1)
                               if explorer_train else None),
        "explorer_rollout_mib": (round(statistics.median(explorer_rollout) / MiB, 1)
                                 if explorer_rollout else None),
        "train_s": median_span("train"), "sleep_s": median_span("sleep"),
        "wake_s": median_span("wake"), "load_s": median_span("sync"),
        "released_mib": next((round(s["attrs"]["released_bytes"] / MiB, 1) for s in spans
                              if s["kind"] == "sleep"), None),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | peak tree MiB | of it: trainer / explorer / shm MiB | peak in training "
             "MiB | explorer in training MiB | explorer rolling out MiB | train step s | "
             "sleep s | wake s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = r["peak_by_role_mib"]
        lines.append(f"| {r['mode']} | {r['peak_total_mib']} | {by.get('trainer', 0)} / "
                     f"{by.get('explorer', 0)} / {r['peak_shm_mib']} | "
                     f"{r['peak_in_training_mib']} | "
                     f"{r['explorer_train_mib']} | {r['explorer_rollout_mib']} | {r['train_s']} | "
                     f"{r['sleep_s'] or '-'} | {r['wake_s'] or '-'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    parser.add_argument("--out", default=".bench/bench_colocate.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-colocate-") as tmp:
        root = Path(tmp)
        model = build_model(root / "model", args.hidden, args.layers)
        params = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        print(f"model: hidden {args.hidden}, {args.layers} layers, {params / MiB:.1f} MiB of "
              f"weights; {args.steps} steps per run", flush=True)
        for rnd in range(args.rounds):
            for colocate in (False, True):
                work = root / f"r{rnd}"
                work.mkdir(exist_ok=True)
                row = one_run(work, model, colocate=colocate, steps=args.steps,
                              interval=args.interval)
                row["round"] = rnd
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"hidden": args.hidden, "layers": args.layers,
                               "weights_mib": round(params / MiB, 1), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
