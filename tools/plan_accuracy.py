"""How close `tandem plan --from` comes to real runs: replay a `tools/bench_sync.py` invocation's
saved run dirs with the plan code of the working tree, or of a git revision, and compare.

    .venv/bin/python tools/plan_accuracy.py [--runs .bench/bench_sync/runs] [--rev REV]
        [--stretch-from SCHEDULE] [--json OUT]

The plan is a pure function of a trace, so old and new plan code can be compared on the same
runs, without the noise of running them again. For every round and ratio, the synchronous run's
trace is measured (`plan_from.measure`) and every schedule of bench_sync is replayed over it;
the prediction (the replay's steady step time) is set against each schedule's own run (the
spacing of its train steps' ends). `--rev` evaluates the plan code of that revision the way
bench_sync did then (means of the synchronous run's spans, no gaps, no sharing);
`--stretch-from fully_async` fits the sharing of the cores to that schedule's run of the same
round and ratio (`plan --from SYNC_RUN --stretch-from ITS_RUN`). It prints one row per run and
the distribution of the errors (prediction / measured - 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from bench_sync import SCHEDULES  # tools/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
MASTER = "packages/master/src/tandem/master"
TARGET = 0.10


def plan_code(rev: str | None) -> ModuleType:
    """`tandem.master.plan_from` of the working tree, or of `rev` (as a throwaway package)."""
    if rev is None:
        return importlib.import_module("tandem.master.plan_from")
    root = Path(tempfile.mkdtemp(prefix="plan_rev_"))
    package = root / "plan_rev"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("plan_from", "simulate", "timeline", "render"):
        text = subprocess.run(["git", "show", f"{rev}:{MASTER}/{name}.py"], cwd=REPO,
                              check=True, capture_output=True, text=True).stdout
        (package / f"{name}.py").write_text(text)
    sys.path.insert(0, str(root))
    pf = importlib.import_module("plan_rev.plan_from")
    load = pf.load_timeline

    def rollout_lanes_only(run_dir):  # the buffer's sample waits came later than some revs
        tl = load(run_dir)
        tl.explorers = [e for e in tl.explorers if any(s.kind == "rollout" for s in tl.lane(e))]
        return tl

    pf.load_timeline = rollout_lanes_only
    return pf


def measured_step(run_dir: Path) -> float | None:
    from tandem.common.trace import read_trace
    from tandem.master.plan_from import steady_step_time

    ends = [s["end"] for s in read_trace(run_dir) if s["kind"] == "train"
            and s["component"] == "trainer"]
    return steady_step_time(ends) if len(ends) >= 3 else None


def predictions(pf: ModuleType, sync_dir: Path, steps: int, old: bool,
                stretch_dir: Path | None) -> dict[str, float]:
    from tandem.common.sync import SyncPlan, preset_explorers

    d = pf.measure(sync_dir)
    if stretch_dir is not None:
        d = replace(d, sharing=pf.measure(stretch_dir).sharing)
    out = {}
    for schedule, (preset, knobs) in SCHEDULES.items():
        n = preset_explorers(preset)
        plan = SyncPlan.preset(preset, batches_per_step=n, **knobs)
        if old:  # bench_sync.predictions before the gaps and the sharing
            mine = pf.Durations(explorers=[f"explorer-{i}" for i in range(n)],
                                rollout=[statistics.fmean(d.rollout)] * n,
                                load=[statistics.fmean(d.load)] * n, train=d.train,
                                publish=d.publish, steps=steps, step_time=d.step_time)
        else:
            mine = d.with_explorers(n, rollout_share=1 / n)
        out[schedule] = pf.predict(mine, schedule, plan, steps).steady_step_time
    return out


def own_prediction(pf: ModuleType, run_dir: Path, schedule: str) -> float:
    """The run's own knobs replayed over its own trace (`plan --from RUN_DIR`'s first row)."""
    from tandem.common.sync import SyncPlan, preset_explorers

    preset, knobs = SCHEDULES[schedule]
    n = preset_explorers(preset)
    d = pf.measure(run_dir)
    return pf.predict(d, schedule, SyncPlan.preset(preset, batches_per_step=n, **knobs),
                      d.steps).steady_step_time


def advice_check(pf: ModuleType, by: dict[str, Path], bound: int) -> str:
    """`plan --from SYNC_RUN --advise --max-staleness bound`'s top pick, and the bench's
    schedules within the bound ranked by the plan against the same schedules' measured runs."""
    from tandem.common.sync import SyncPlan, preset_explorers

    d = pf.measure(by["synchronous"])
    top = pf.rank(d, bound)[0]
    predicted, measured = {}, {}
    for schedule, (preset, knobs) in SCHEDULES.items():
        n = preset_explorers(preset)
        plan = SyncPlan.preset(preset, batches_per_step=n, **knobs)
        p = pf.predict(d.with_explorers(n, rollout_share=1 / n), schedule, plan)
        step = measured_step(by[schedule]) if schedule in by else None
        if p.staleness()[1] <= bound and step is not None:
            predicted[schedule], measured[schedule] = p.steady_step_time, step
    order = sorted(predicted, key=predicted.get)
    real = sorted(measured, key=measured.get)
    return (f"top pick {pf.knobs_text(top.plan)} at {top.steady_step_time:.3f} s; of the "
            f"bench's schedules the plan ranks {', '.join(f'{s} {predicted[s]:.3f}' for s in order)}"
            f"; measured {', '.join(f'{s} {measured[s]:.3f}' for s in real)}; the plan's first "
            f"is the measured {real.index(order[0]) + 1}. of {len(real)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=".bench/bench_sync/runs",
                        help="bench_sync's run dirs (r<round>-x<ratio>-<schedule>)")
    parser.add_argument("--rev", default=None, help="git revision whose plan code to evaluate")
    parser.add_argument("--stretch-from", default=None, choices=list(SCHEDULES),
                        help="fit the sharing to this schedule's run of the same round/ratio")
    parser.add_argument("--own", action="store_true",
                        help="predict each run from its own trace instead (plan --from RUN_DIR "
                             "with the run's knobs): the model without the drift of the load "
                             "from one run to the next")
    parser.add_argument("--advise", type=int, default=None, metavar="K",
                        help="instead: per round and ratio, --advise --max-staleness K's top "
                             "pick and the plan's ranking of the bench's schedules against the "
                             "measured one")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    from tandem.common.trace import read_trace

    pf = plan_code(args.rev)
    runs: dict[tuple[int, str], dict[str, Path]] = {}
    for path in sorted(Path(args.runs).iterdir()):
        m = re.fullmatch(r"r(\d+)-x([\d.]+)-(\w+)", path.name)
        if m and (path / "trace").is_dir():
            runs.setdefault((int(m[1]), m[2]), {})[m[3]] = path
    rows: list[dict[str, Any]] = []
    for (rnd, ratio), by in sorted(runs.items()):
        if "synchronous" not in by:
            continue
        if args.advise is not None:
            try:
                print(f"round {rnd} ratio {ratio}: {advice_check(pf, by, args.advise)}")
            except Exception as exc:  # a round still going
                print(f"skipped round {rnd} ratio {ratio}: {type(exc).__name__}: {exc}")
            continue
        stretch = by.get(args.stretch_from) if args.stretch_from else None
        steps = len([1 for s in read_trace(by["synchronous"]) if s["kind"] == "train"
                     and s["component"] == "trainer"])
        try:
            predicted = ({s: own_prediction(pf, by[s], s) for s in by} if args.own else
                         predictions(pf, by["synchronous"], steps, args.rev is not None, stretch))
        except Exception as exc:  # a run still going, or one that failed before training
            print(f"skipped round {rnd} ratio {ratio}: {type(exc).__name__}: {exc}")
            continue
        for schedule in SCHEDULES:
            if schedule not in by or by[schedule] == stretch:
                continue
            try:
                measured = measured_step(by[schedule])
            except Exception:
                measured = None
            if measured is None:
                continue
            rows.append({"round": rnd, "ratio": ratio, "schedule": schedule,
                         "measured": measured, "predicted": predicted[schedule],
                         "error": predicted[schedule] / measured - 1})
    if args.advise is not None:
        return 0
    print("| round | ratio | schedule | measured s | plan s | error |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['round']} | {r['ratio']} | {r['schedule']} | {r['measured']:.3f} | "
              f"{r['predicted']:.3f} | {r['error']:+.0%} |")
    errors = sorted(r["error"] for r in rows)
    if errors:
        inside = sum(abs(e) <= TARGET for e in errors)
        q = statistics.quantiles(errors, n=4) if len(errors) > 1 else errors * 3
        print(f"plan code {args.rev or 'working tree'}{', each run from its own trace' if args.own else ''}"
              f"{', sharing from ' + args.stretch_from if args.stretch_from else ''}: within "
              f"{TARGET:.0%} in {inside} of {len(errors)} runs; error median {q[1]:+.0%}, "
              f"quartiles {q[0]:+.0%} / {q[2]:+.0%}, min {errors[0]:+.0%}, max {errors[-1]:+.0%}, "
              f"median |error| {statistics.median(abs(e) for e in errors):.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
