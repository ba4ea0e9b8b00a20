"""`tandem plan --from RUN_DIR`: what other sync knobs would have done with a real run's times.

The durations come from the run's trace: the mean rollout and checkpoint load of each explorer,
the mean train step and the mean publish (checkpoint write, or broadcast) of the trainer, each
leaving out its lane's first span, which also pays for warm-up. The mean, not the median: the
wall-clock is the sum of the steps, slow ones included (on a shared machine a few steps take
many times the median). Every preset and the run's own
knobs (or the ones given on the command line) are replayed over them with the simulator that
`tandem plan` uses, which applies the master's own `SyncPlan`; `advise` searches the knobs for
the most throughput whose staleness stays within a bound.

The replay keeps the measured durations fixed: it does not know that a step would run faster or
slower once the two sides overlap and share the machine's cores (see `placement`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from tandem.common.sync import PRESETS, SyncPlan, preset_explorers

from .simulate import Timeline, simulate
from .timeline import RunTimeline, load_timeline


@dataclass
class Durations:
    """Seconds per piece of work, as a run measured them."""

    explorers: list[str]
    rollout: list[float]  # per explorer
    load: list[float]  # per explorer
    train: float
    publish: float
    steps: int  # trainer steps the run trained
    step_time: float  # the run's own wall-clock per trainer step

    def to_json(self) -> dict[str, Any]:
        return {"explorers": self.explorers, "rollout": self.rollout, "load": self.load,
                "train": self.train, "publish": self.publish, "steps": self.steps,
                "step_time": self.step_time}


def _typical(values: list[float]) -> float:
    """The mean of the spans after the first (the warm-up), or of all when there is one."""
    return statistics.fmean(values[1:] if len(values) > 1 else values) if values else 0.0


def steady_step_time(train_ends: list[float]) -> float:
    """Seconds per trainer step once the run is going: the spacing of the train steps' ends from
    the first to the last. A makespan also holds the start-up and the first step's warm-up,
    which a short run's per-step figure would otherwise charge to the schedule."""
    if len(train_ends) < 2:
        raise ValueError(f"a steady step time needs two train steps or more, got "
                         f"{len(train_ends)}")
    ends = sorted(train_ends)
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def _required(values: list[float], what: str, where: str) -> float:
    if not values:
        raise click.ClickException(f"{where}: the trace has no {what} spans to measure")
    return _typical(values)


def measure(run_dir: str | Path) -> Durations:
    """The durations of `run_dir`'s trace (ClickException when it has none to measure)."""
    tl: RunTimeline = load_timeline(run_dir)
    where = str(run_dir)
    if not tl.explorers:
        raise click.ClickException(f"{where}: the trace has no explorer lane")

    def spans(lane: str, kind: str) -> list[float]:
        return [s.end - s.start for s in sorted(tl.lane(lane), key=lambda s: s.start)
                if s.kind == kind]

    trains = spans("trainer", "train")
    return Durations(
        explorers=tl.explorers,
        rollout=[_required(spans(e, "rollout"), f"{e} rollout", where) for e in tl.explorers],
        load=[_typical(spans(e, "sync")) for e in tl.explorers],
        train=_required(trains, "trainer train", where),
        publish=_typical(spans("trainer", "sync")),
        steps=len(trains),
        step_time=tl.makespan / len(trains))


@dataclass
class Prediction:
    """One set of knobs replayed over the measured durations."""

    name: str
    plan: SyncPlan
    timeline: Timeline
    steps: int

    @property
    def step_time(self) -> float:
        return self.timeline.makespan / self.steps

    @property
    def steady_step_time(self) -> float:
        """The replay's `steady_step_time`, comparable with a run's own (bench_sync.py)."""
        return steady_step_time([b.end for b in self.timeline.lane("trainer", "train")])

    def staleness(self) -> tuple[float, int]:
        """Mean and max of (explorer step - weight version) over the replayed rollouts."""
        ages = [b.step - b.version for b in self.timeline.blocks
                if b.kind == "rollout" and b.step is not None and b.version is not None]
        return (sum(ages) / len(ages), max(ages)) if ages else (0.0, 0)

    def to_json(self) -> dict[str, Any]:
        util = self.timeline.utilization()
        mean, worst = self.staleness()
        return {"name": self.name, "knobs": self.plan.describe(),
                "step_time": round(self.step_time, 4), "trainer_busy": util["trainer"],
                "explorers_busy": util["explorers"], "staleness_mean": round(mean, 3),
                "staleness_max": worst}


def predict(d: Durations, name: str, plan: SyncPlan, steps: int | None = None) -> Prediction:
    steps = steps or max(d.steps, 1)
    timeline = simulate(plan, steps=steps, rollout_times=d.rollout, train_time=d.train,
                        sync_time=d.publish, load_times=d.load, compare=False)
    return Prediction(name, plan, timeline, steps)


def replay_all(d: Durations, own: SyncPlan, steps: int | None = None) -> list[Prediction]:
    """The run's own knobs, then every preset that fits its number of explorers."""
    n = len(d.rollout)
    out = [predict(d, "your knobs", own, steps)]
    for name in PRESETS:
        if n < preset_explorers(name):
            continue  # multi_explorer_async with one explorer is fully_async
        out.append(predict(d, name, SyncPlan.preset(name, batches_per_step=n), steps))
    return out


def candidates(max_staleness: int, batches_per_step: int) -> list[SyncPlan]:
    """Every set of knobs whose staleness bound can stay within `max_staleness`."""
    out = []
    for method in ("nccl", "checkpoint"):
        for interval in range(1, max_staleness + 2):
            for offset in range(max_staleness + 2 - interval):
                out.append(SyncPlan(method=method, interval=interval, offset=offset,
                                    max_staleness=max_staleness,
                                    batches_per_step=batches_per_step))
        if max_staleness >= 1:  # an asynchronous plan needs room for one version of lag
            for interval in range(1, max_staleness + 1):
                try:
                    out.append(SyncPlan(method=method, interval=interval, offset=None,
                                        max_staleness=max_staleness,
                                        batches_per_step=batches_per_step))
                except ValueError:
                    continue
    return out


def advise(d: Durations, own: Prediction, max_staleness: int,
           steps: int | None = None) -> Prediction:
    """The knobs with the shortest predicted step time whose replayed staleness never exceeds
    `max_staleness` (ties go to the fresher, then the simpler plan)."""
    best: tuple[tuple, Prediction] | None = None
    for plan in candidates(max_staleness, len(d.rollout)):
        try:
            p = predict(d, "advised", plan, steps)
        except (ValueError, RuntimeError):  # knobs the rules refuse, or a deadlocked plan
            continue
        mean, worst = p.staleness()
        if worst > max_staleness:
            continue
        key = (round(p.step_time, 6), mean, plan.interval, plan.offset is None)
        if best is None or key < best[0]:
            best = (key, p)
    if best is None:
        raise click.ClickException(f"no knobs keep staleness within {max_staleness}")
    return best[1]


def knobs_text(plan: SyncPlan) -> str:
    offset = "null" if plan.offset is None else plan.offset
    return (f"{plan.method} interval {plan.interval} offset {offset} "
            f"max_staleness {plan.max_staleness}")


def print_report(d: Durations, predictions: list[Prediction], advice: Prediction | None,
                 own: Prediction, bound: int | None) -> None:
    echo = click.echo
    rollouts = ", ".join(f"{n} {r:.3f}s (load {x:.3f}s)"
                         for n, r, x in zip(d.explorers, d.rollout, d.load))
    echo(f"measured: rollout {rollouts}; train {d.train:.3f}s; publish {d.publish:.3f}s; "
         f"{d.steps} steps at {d.step_time:.3f}s each")
    header = (f"{'plan':<22} {'knobs':<50} {'step s':>7} {'trainer':>8} {'explorers':>10} "
              f"{'stale mean/max':>15}")
    echo(header)
    echo("-" * len(header))
    for p in predictions + ([advice] if advice is not None else []):
        util = p.timeline.utilization()
        explorers = sum(util["explorers"]) / len(util["explorers"])
        mean, worst = p.staleness()
        echo(f"{p.name:<22} {knobs_text(p.plan):<50} {p.step_time:>7.3f} "
             f"{util['trainer']:>8.0%} {explorers:>10.0%} {f'{mean:.2f} / {worst}':>15}")
    if advice is not None:
        gain = own.step_time / advice.step_time
        echo(f"advice (staleness <= {bound}): sync.method={advice.plan.method} "
             f"sync.interval={advice.plan.interval} sync.offset="
             f"{'null' if advice.plan.offset is None else advice.plan.offset} "
             f"sync.max_staleness={advice.plan.max_staleness}: predicted {gain:.2f}x the "
             f"throughput of your knobs ({own.step_time:.3f}s -> {advice.step_time:.3f}s a step)")
