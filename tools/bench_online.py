"""Online RL from live traffic, measured: examples/online.yaml trained by `tandem up` from the
conversations of examples/online_app.py (a scripted user of the quickstart task on the official
`openai` client), for several seeds, one after another in one invocation.

    .venv/bin/python tools/bench_online.py [--steps 40] [--seeds 0,1,2] [--root .bench/online]
        [--out .bench/online.json]

Each seed warm-starts the quickstart's tiny Qwen2 (80 SFT steps: the format known, the answer
often wrong), runs the example for `--steps` trainer steps with the application as its own
process, and reads the reward per step from the trace's rollout spans and the application's
accuracy per round from its log. Reported per seed: the mean reward of the first and of the last
third of the steps, the application's exact-answer accuracy in its first and last rounds, episodes
expired, and wall seconds. Prints a table, writes JSON.

`run_online` is also what tests/e2e/test_online.py runs (a few steps, asserting the mechanism:
every step trained from the application's conversations, nothing expired); whether the reward
rises is a measurement over enough steps and seeds, made here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class OnlineRun:
    """What one run of the example left: its trace, its curve and the application's rounds."""

    run_dir: Path
    code: int
    app_code: int | None
    app_err: str
    seconds: float
    spans: list[dict[str, Any]] = field(repr=False)
    curve: list[float]
    rounds: list[dict[str, Any]]

    @property
    def expired(self) -> int:
        return sum(1 for s in self.spans if s["kind"] == "online_expired")


def warm_started(root: Path, seed: int) -> tuple[Path, Path]:
    """The quickstart's model after its short SFT, and the training rows as JSONL."""
    from tandem.master.quickstart import prepare

    prepare(root, seed=seed)
    return root / "model-sft", root / "data" / "train.jsonl"


def run_online(root: Path, model: Path, data: Path, *, steps: int, seed: int = 0,
               run_timeout: float = 240) -> OnlineRun:
    """examples/online.yaml for `steps` trainer steps from `model`, with examples/online_app.py
    driving its endpoint until the run ends."""
    from tandem.common.config import RunConfig
    from tandem.common.trace import read_trace
    from tandem.master.up import run_up

    run_dir = root / "run"
    raw = yaml.safe_load((ROOT / "examples" / "online.yaml").read_text())
    raw.update(run_dir=str(run_dir), seed=seed, model={"path": str(model)},
               logging={"level": "warning", "metrics": {"enabled": False}},
               up={"timeline": False, "run_timeout": run_timeout})
    raw["master"]["total_steps"] = steps
    raw["explorers"][0]["engine"] = {"options": {"threads": 1}}
    config = RunConfig.model_validate(raw)
    log = root / "app.jsonl"
    app = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "online_app.py"),
         "--url-file", str(run_dir / "openai" / "explorer-0.url"), "--data", str(data),
         "--group-size", "8", "--questions", "8", "--seconds", str(run_timeout),
         "--wait", str(run_timeout), "--seed", str(seed), "--log", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    err = ""
    try:
        code = run_up(config, live=False)
        # the endpoint is gone with the run: the application's next call fails and it exits
        _, err = app.communicate(timeout=run_timeout)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
    spans = read_trace(config.run_dir)
    rollouts = sorted((s for s in spans if s["kind"] == "rollout"), key=lambda s: s["step"])
    rounds = ([json.loads(line) for line in log.read_text().splitlines()] if log.exists()
              else [])
    return OnlineRun(run_dir=run_dir, code=code, app_code=app.returncode, app_err=err,
                     seconds=time.monotonic() - start, spans=spans,
                     curve=[s["attrs"]["reward_mean"] for s in rollouts], rounds=rounds)


def thirds(values: list[float]) -> tuple[float, float]:
    """The mean of the first and of the last third of `values`."""
    third = max(1, len(values) // 3)
    return statistics.mean(values[:third]), statistics.mean(values[-third:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--root", type=Path, default=ROOT / ".bench" / "online")
    parser.add_argument("--out", type=Path, default=ROOT / ".bench" / "online.json")
    args = parser.parse_args()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        root = args.root / f"seed{seed}"
        model, data = warm_started(root, seed)
        run = run_online(root, model, data, steps=args.steps, seed=seed,
                         run_timeout=max(240, 6 * args.steps))
        first, last = thirds(run.curve)
        acc = [r["accuracy"] for r in run.rounds]
        acc_first, acc_last = thirds(acc) if acc else (float("nan"), float("nan"))
        rows.append(dict(seed=seed, code=run.code, steps=len(run.curve), reward_first=first,
                         reward_last=last, accuracy_first=acc_first, accuracy_last=acc_last,
                         expired=run.expired, seconds=round(run.seconds, 1), curve=run.curve))
    print(f"{'seed':>4} {'exit':>4} {'steps':>5} {'reward first→last third':>24} "
          f"{'app accuracy first→last third':>30} {'expired':>7} {'s':>6}")
    for r in rows:
        print(f"{r['seed']:>4} {r['code']:>4} {r['steps']:>5} "
              f"{r['reward_first']:>11.3f} → {r['reward_last']:<10.3f} "
              f"{r['accuracy_first']:>14.3f} → {r['accuracy_last']:<13.3f} "
              f"{r['expired']:>7} {r['seconds']:>6}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "runs": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
