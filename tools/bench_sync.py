"""The schedule benchmark: every sync schedule through the real multi-process system, side by
side, at several rollout/train ratios, against the ideal overlap and `tandem plan`'s prediction.

    .venv/bin/python tools/bench_sync.py [--steps 20] [--rounds 2] [--ratios 0.5,1,2]
        [--presets synchronous,one_step_off_policy,...] [--threads N]
        [--out .bench/bench_sync.json] [--quick]

Each run is `tandem up examples/<preset>.yaml --set ... --plain` (placement `auto`, the quickstart
task and its warm-started tiny Qwen2, built once by `tandem quickstart`'s own functions into a
cache beside `--out`). The schedules: the four presets, plus `synchronous` with `sync.interval 4,
offset 0` (`interval4_offset0`) and with `interval 1, offset 4` (`interval1_offset4`). The ratios
are nominal: 1 is the quickstart's settings; 0.5 makes the trainer slower
(`trainer.micro_batch_tokens`, more micro-batches for the same tokens: the same update, more
passes); 2 makes the explorer slower (`engine.max_batch`, fewer sequences generated at once: the
same samples, more passes). The measured R/T, from the synchronous run's trace, is printed next to
the nominal one. Runs are interleaved: every round runs every ratio's schedules in turn, so each
comparison is between runs a few minutes apart on a shared machine. `--threads N` gives every
schedule's trainer and explorers N threads: placement `auto` gives each side of `synchronous`
every core (they alternate), so without it the synchronous trace measures the sides on other
threads than the overlapping schedules run with (docs/benchmarks.md says what that does on a
loaded machine).

From each run's trace (run_dir/trace): the wall-clock per trainer step in the steady state (the
spacing of the train steps' ends, `plan_from.steady_step_time`, which leaves out start-up and the
first step's warm-up); the staleness of every rollout (step - version); the rollout reward of
the last batches; at nominal ratio 1 the held-out accuracy after the last step (the run's `eval`
section, run_dir/eval.jsonl). From the round's synchronous run: R and T (`plan_from.measure`,
means after the first span), the ideal speedup (R + T) / max(R, T), and `tandem plan`'s replay of
every schedule over that trace (its durations, the gaps between its spans and how the sides share
the cores: docs/sync.md), whose steady step time is the prediction. Per schedule and
ratio the table gives the median over rounds of: step time, speedup over the same round's
synchronous run, share of the ideal (speedup / ideal), prediction and its error, and from the
trace's steady state (first train step's end to the last, `RunTimeline.steady_shares`) the
share in which neither side works (no train, no rollout span) and the busy share of the slower
side (issue 27 item 2). Timings are
reported, never pass/fail; the exit code says only whether every run finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from chaos import leftovers  # tools/ is the script's folder
from resume_check import finish, kill_everything

REPO = Path(__file__).resolve().parents[1]
TANDEM = str(Path(sys.executable).parent / "tandem")
# schedule name -> (example preset it starts from, sync knobs set on top)
SCHEDULES: dict[str, tuple[str, dict[str, Any]]] = {
    "synchronous": ("synchronous", {}),
    "one_step_off_policy": ("one_step_off_policy", {}),
    "fully_async": ("fully_async", {}),
    "multi_explorer_async": ("multi_explorer_async", {}),
    "interval4_offset0": ("synchronous", {"interval": 4, "offset": 0}),
    "interval1_offset4": ("synchronous", {"interval": 1, "offset": 4}),
}
BASELINE = "synchronous"
# nominal rollout/train ratio -> (trainer keys, keys set on every explorer)
RATIOS: dict[float, tuple[dict[str, Any], dict[str, Any]]] = {
    0.5: ({"micro_batch_tokens": 1024}, {}),
    1.0: ({}, {}),
    2.0: ({}, {"engine.max_batch": 16}),
}
TARGET_SHARE, TARGET_PLAN_ERROR, TARGET_ACCURACY = 0.9, 0.10, 0.05
# issue 27 item 2: synchronous idles under 5% of the steady state; an overlapping schedule's
# slower side is busy at least 95% of it
TARGET_NEITHER, TARGET_SLOWER_BUSY = 0.05, 0.95


# -- pure pieces (tests/master/test_bench_sync.py) ---------------------------------------------


def ideal_speedup(rollout: float, train: float) -> float:
    """What perfect overlap of rollout and training buys over doing them one after the other."""
    if rollout <= 0 or train <= 0:
        raise ValueError(f"rollout and train must be > 0 seconds, got {rollout}, {train}")
    return (rollout + train) / max(rollout, train)


def staleness(spans: list[dict[str, Any]]) -> tuple[float, int]:
    """Mean and max of (step - version) over the trace's rollout spans."""
    ages = [s["step"] - s["version"] for s in spans if s.get("kind") == "rollout"
            and s.get("step") is not None and s.get("version") is not None]
    return (sum(ages) / len(ages), max(ages)) if ages else (0.0, 0)


def reward_after(spans: list[dict[str, Any]], last: int = 5) -> float | None:
    """The mean rollout reward of the `last` batches to finish."""
    rollouts = sorted((s for s in spans if s.get("kind") == "rollout"
                       and "reward_mean" in (s.get("attrs") or {})), key=lambda s: s["end"])
    rewards = [s["attrs"]["reward_mean"] for s in rollouts[-last:]]
    return sum(rewards) / len(rewards) if rewards else None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (ratio, schedule): medians over rounds, each run set against its own round's
    synchronous run (its step time, its trace's ideal and plan)."""
    base = {(r["round"], r["ratio"]): r for r in runs if r["schedule"] == BASELINE and r["ok"]}
    rows = []
    keys = sorted({(r["ratio"], r["schedule"]) for r in runs},
                  key=lambda k: (k[0], list(SCHEDULES).index(k[1])))
    for ratio, schedule in keys:
        mine = [r for r in runs if (r["ratio"], r["schedule"]) == (ratio, schedule) and r["ok"]]
        speedup, ideal, share, error, measured_ratio = [], [], [], [], []
        for r in mine:
            b = base.get((r["round"], ratio))
            if b is None:
                continue
            measured_ratio.append(b["rollout"] / b["train"])
            ideal.append(ideal_speedup(b["rollout"], b["train"]))
            speedup.append(b["step_time"] / r["step_time"])
            share.append(speedup[-1] / ideal[-1])
            predicted = b["predicted"].get(schedule)
            if predicted is not None:
                error.append(predicted / r["step_time"] - 1)
        accuracy = [r["heldout"] for r in mine if r.get("heldout")]
        rows.append({
            "ratio": ratio, "schedule": schedule, "runs": len(mine),
            "failed": sum(1 for r in runs if (r["ratio"], r["schedule"]) == (ratio, schedule)
                          and not r["ok"]),
            "measured_ratio": _median(measured_ratio),
            "step_time": _median([r["step_time"] for r in mine]),
            "speedup": _median(speedup), "ideal": _median(ideal), "share": _median(share),
            "predicted": _median([base[(r["round"], ratio)]["predicted"].get(schedule)
                                  for r in mine if (r["round"], ratio) in base]),
            "plan_error": _median(error),
            "neither": _median([r.get("neither") for r in mine]),
            "slower_busy": _median([r.get("slower_busy") for r in mine]),
            "staleness_mean": _median([r["staleness_mean"] for r in mine]),
            "staleness_max": max((r["staleness_max"] for r in mine), default=None),
            "reward": _median([r["reward"] for r in mine]),
            "sampled_accuracy": _median([a["sampled/accuracy"] for a in accuracy]),
            "greedy_accuracy": _median([a["greedy/accuracy"] for a in accuracy]),
        })
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The targets, each met or not, in a line."""
    out = []
    by = {(r["ratio"], r["schedule"]): r for r in rows}
    for r in rows:
        if r["schedule"] in ("one_step_off_policy", "fully_async") and r["share"] is not None:
            met = r["share"] >= TARGET_SHARE
            out.append(f"{'met' if met else 'NOT met'}: {r['schedule']} at ratio {r['ratio']:g} "
                       f"reaches {r['share']:.0%} of the ideal (target {TARGET_SHARE:.0%})")
    for r in rows:
        if r["schedule"] == BASELINE and r.get("neither") is not None:
            met = r["neither"] < TARGET_NEITHER
            out.append(f"{'met' if met else 'NOT met'}: synchronous at ratio {r['ratio']:g} "
                       f"has neither side working {r['neither']:.1%} of the steady state "
                       f"(target < {TARGET_NEITHER:.0%})")
        elif r["schedule"] in ("one_step_off_policy", "fully_async", "multi_explorer_async") \
                and r.get("slower_busy") is not None:
            met = r["slower_busy"] >= TARGET_SLOWER_BUSY
            out.append(f"{'met' if met else 'NOT met'}: {r['schedule']} at ratio {r['ratio']:g} "
                       f"keeps its slower side busy {r['slower_busy']:.1%} of the steady state "
                       f"(target >= {TARGET_SLOWER_BUSY:.0%})")
    errors = [abs(r["plan_error"]) for r in rows if r["plan_error"] is not None]
    if errors:
        inside = sum(1 for e in errors if e <= TARGET_PLAN_ERROR)
        out.append(f"{'met' if inside == len(errors) else 'NOT met'}: the plan is within "
                   f"{TARGET_PLAN_ERROR:.0%} of the measured step time in {inside} of "
                   f"{len(errors)} rows (worst {max(errors):.0%})")
    for r in rows:
        b = by.get((r["ratio"], BASELINE))
        if r["schedule"] == BASELINE or b is None or None in (r["sampled_accuracy"],
                                                               b["sampled_accuracy"]):
            continue
        gap = r["sampled_accuracy"] - b["sampled_accuracy"]
        out.append(f"{'met' if abs(gap) <= TARGET_ACCURACY else 'NOT met'}: {r['schedule']} "
                   f"held-out sampled accuracy {r['sampled_accuracy']:.2f} vs synchronous "
                   f"{b['sampled_accuracy']:.2f} ({gap:+.2f}, target within {TARGET_ACCURACY})")
    return out


# -- the runs -------------------------------------------------------------------------------


def build_model(cache: Path, seed: int) -> Path:
    """The quickstart's warm-started tiny model and its train / held-out tasks, built once."""
    from tandem.master.quickstart import prepare

    if not (cache / "model-sft" / "config.json").exists():
        prepare(cache, seed=seed)
    return cache


def overrides(schedule: str, ratio: float, *, run_dir: Path, cache: Path, steps: int,
              evaluate: bool, threads: int | None = None) -> tuple[Path, list[str]]:
    """The example config of `schedule` and the `--set` assignments that make this run."""
    preset, knobs = SCHEDULES[schedule]
    config = REPO / "examples" / f"{preset}.yaml"
    explorers = len(yaml.safe_load(config.read_text())["explorers"])
    trainer_keys, explorer_keys = RATIOS[ratio]
    sets = [f"run_dir={run_dir}", f"model.path={cache / 'model-sft'}",
            f"master.taskset.path={cache / 'data' / 'train.jsonl'}", f"master.total_steps={steps}",
            # a loaded machine otherwise declares a busy component dead, and other runs may
            # hold the fixed /metrics ports
            "transport.liveness=60", "logging.metrics.port=0",
            # no timeline.png: drawing it would run beside the next run
            "up.timeline=false"]
    sets += [f"sync.{k}={v}" for k, v in knobs.items()]
    sets += [f"trainer.{k}={v}" for k, v in trainer_keys.items()]
    sets += [f"explorers.{i}.{k}={v}" for i in range(explorers) for k, v in explorer_keys.items()]
    if threads is not None:  # every schedule's sides on the same threads (placement otherwise
        # gives each side of synchronous every core, since they alternate)
        sets += [f"placement.trainer.threads={threads}", f"placement.explorers.threads={threads}"]
    if evaluate:  # after the last step only: the start is the same warm start for every run
        sets += [f"eval.tasksets=[{{name: heldout, path: {cache / 'data' / 'heldout.jsonl'}}}]",
                 "eval.at_start=false"]
    return config, sets


def measure_run(run_dir: Path) -> dict[str, Any]:
    """What one finished run's trace and eval.jsonl say."""
    from tandem.common.trace import read_trace
    from tandem.master.plan_from import measure, steady_step_time
    from tandem.master.timeline import load_timeline

    spans = read_trace(run_dir)
    trains = [s["end"] for s in spans if s["kind"] == "train" and s["component"] == "trainer"]
    d = measure(run_dir)
    mean, worst = staleness(spans)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()
             ] if (run_dir / "eval.jsonl").exists() else []
    heldout = [e for e in evals if e.get("taskset") == "heldout"]
    shares = load_timeline(run_dir).steady_shares() or {}
    return {
        "steps": len(trains), "step_time": steady_step_time(trains),
        "rollout": statistics.fmean(d.rollout), "train": d.train, "publish": d.publish,
        "load": statistics.fmean(d.load), "explorers": len(d.explorers),
        "staleness_mean": mean, "staleness_max": worst, "reward": reward_after(spans),
        "heldout": heldout[-1]["metrics"] if heldout else None,
        "heldout_version": heldout[-1]["version"] if heldout else None,
        "neither": shares.get("neither"), "slower_busy": shares.get("slower_busy"),
    }


def predictions(run: dict[str, Any], steps: int) -> dict[str, float]:
    """`tandem plan`'s steady step time for every schedule, replayed over this synchronous
    run's trace (`plan_from.measure`: durations, the gaps between spans, and how the sides share
    the cores). multi_explorer_async's two explorers each roll out half the batch."""
    from tandem.common.sync import SyncPlan, preset_explorers
    from tandem.master.plan_from import measure, predict

    d = measure(run["run_dir"])
    out = {}
    for schedule, (preset, knobs) in SCHEDULES.items():
        n = preset_explorers(preset)
        plan = SyncPlan.preset(preset, batches_per_step=n, **knobs)
        out[schedule] = predict(d.with_explorers(n, rollout_share=1 / n), schedule, plan,
                                steps).steady_step_time
    return out


def run_one(root: Path, cache: Path, schedule: str, ratio: float, rnd: int, *, steps: int,
            evaluate: bool, timeout: float, threads: int | None) -> dict[str, Any]:
    run_dir = root / f"r{rnd}-x{ratio:g}-{schedule}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a trace appends: start from nothing
    config, sets = overrides(schedule, ratio, run_dir=run_dir, cache=cache, steps=steps,
                             evaluate=evaluate, threads=threads)
    argv = [TANDEM, "up", str(config), "--plain"] + [a for s in sets for a in ("--set", s)]
    record: dict[str, Any] = {"round": rnd, "ratio": ratio, "schedule": schedule,
                              "run_dir": str(run_dir), "load_before": os.getloadavg()[0]}
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        code, out = finish(proc, timeout)
    except KeyboardInterrupt:  # the table of what finished still follows
        kill_everything(proc)
        raise
    # `tandem up` draws timeline.png in a detached process: let it end before the next run
    deadline = time.monotonic() + 60
    while leftovers(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    record.update(seconds=round(time.monotonic() - started, 1), exit_code=code,
                  load_after=os.getloadavg()[0])
    try:
        record.update(measure_run(run_dir))
        record["ok"] = code == 0 and record["steps"] == steps
    except Exception as exc:  # a run that failed early has no trace to read
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    if not record["ok"]:
        record["output_tail"] = out[-2000:]
    if schedule == BASELINE and record["ok"]:
        record["predicted"] = predictions(record, steps)
    return record


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| ratio (nominal / measured R/T) | schedule | s per step | speedup | ideal | share "
          "of ideal | plan s | plan error | neither | slower side busy | staleness mean / max "
          "| reward | held-out sampled / greedy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        print(f"| {r['ratio']:g} / {_f(r['measured_ratio'], '.2f')} | {r['schedule']}{failed} | "
              f"{_f(r['step_time'], '.3f')} | {_f(r['speedup'], '.2f')} | "
              f"{_f(r['ideal'], '.2f')} | {_f(r['share'], '.0%')} | {_f(r['predicted'], '.3f')} "
              f"| {_f(r['plan_error'], '+.0%')} | {_f(r.get('neither'), '.1%')} | "
              f"{_f(r.get('slower_busy'), '.1%')} | {_f(r['staleness_mean'], '.2f')} / "
              f"{_f(r['staleness_max'], 'd')} | {_f(r['reward'], '.3f')} | "
              f"{_f(r['sampled_accuracy'], '.2f')} / {_f(r['greedy_accuracy'], '.2f')} |")


def _list(text: str, known, what: str) -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if what == "--ratios":
        try:
            items = [float(x) for x in items]
        except ValueError:
            raise SystemExit(f"--ratios: {text!r} is not a comma list of numbers") from None
    unknown = [x for x in items if x not in known]
    if unknown or not items:
        raise SystemExit(f"{what}: unknown {unknown or text!r}; choose from {list(known)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="trainer steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--ratios", default="0.5,1,2", help=f"nominal R/T, of {list(RATIOS)}")
    parser.add_argument("--presets", default=",".join(SCHEDULES),
                        help="schedules to run (synchronous is always run: the baseline)")
    parser.add_argument("--out", default=".bench/bench_sync.json", help="JSON to write")
    parser.add_argument("--model-cache", default=None,
                        help="where the tiny model is built once (default: beside --out)")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--threads", type=int, default=None,
                        help="placement.trainer.threads and placement.explorers.threads for "
                             "every run (default: placement auto's choice per schedule)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: 4 steps, 1 round, ratio 1")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.ratios = 4, 1, "1"
    if args.steps < 3 or args.rounds < 1:
        parser.error("--steps must be >= 3 (the steady step time needs 2 after the first) "
                     "and --rounds >= 1")
    ratios = _list(args.ratios, RATIOS, "--ratios")
    schedules = _list(args.presets, SCHEDULES, "--presets")
    schedules = [BASELINE] + [s for s in schedules if s != BASELINE]
    out = Path(args.out)
    root = out.with_suffix("")
    cache = build_model(Path(args.model_cache) if args.model_cache else root / "model-cache",
                        args.seed)
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            for ratio in ratios:
                for schedule in schedules:
                    record = run_one(root / "runs", cache, schedule, ratio, rnd,
                                     steps=args.steps, evaluate=ratio == 1.0,
                                     timeout=args.run_timeout, threads=args.threads)
                    runs.append(record)
                    print(f"round {rnd} ratio {ratio:g} {schedule}: "
                          + (f"{record['step_time']:.3f} s/step, run {record['seconds']} s, "
                             f"load {record['load_before']:.1f}-{record['load_after']:.1f}"
                             if record["ok"] else f"FAILED (exit {record['exit_code']}) "
                             f"{record.get('error', '')} {record['run_dir']}"), flush=True)
                    rows = summarise(runs)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps({"args": vars(args), "rows": rows,
                                               "runs": runs}, indent=1))
    except KeyboardInterrupt:
        print(f"interrupted after {len(runs)} runs: the table holds those")
    print(f"\n{args.steps} trainer steps a run, {args.rounds} round(s), medians over rounds")
    print_table(rows)
    for line in verdicts(rows):
        print(line)
    print(f"JSON: {out}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
