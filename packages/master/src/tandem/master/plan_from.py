"""`tandem plan --from RUN_DIR`: what other sync knobs would have done with a real run's times.

From the run's trace it measures three things, and replays every preset and the run's own knobs
(or the ones given on the command line) over them with the simulator that `tandem plan` uses,
which applies the master's own `SyncPlan`; `advise` searches the knobs for the most throughput
whose staleness stays within a bound.

- Durations: the mean rollout and checkpoint load of each explorer, the mean train step and the
  mean publish (checkpoint write, or broadcast from the moment both sides are in it), each
  leaving out its lane's first span, which also pays for warm-up. The mean, not the median: the
  wall-clock is the sum of the steps, slow ones included. Train and rollout spans are taken as
  the work they would be alone (`Sharing` below takes the stretch out).
- Gaps (`measure_gaps`): the time between a span's dependencies and its start, per kind
  (`simulate.Gaps`): a train step after its last batch is in and the trainer's previous span
  ended (the buffer's sample and ack, the master's TrainerGo), a publish after its train step,
  an explorer's load after the version exists (a broadcast: after the trainer is in it), a
  rollout after the explorer's load, and a rollout after its previous rollout (lease-ahead's
  part: with `lease_ahead` the next grant is already in hand). A gap that the run never shows
  (a synchronous run has no rollout after a rollout) is taken from its nearest kind.
- Sharing (`Sharing`): how much the sides slow each other on shared cores. A compute span (train,
  rollout) runs at the rate the machine leaves it: while lanes asking for D threads in all are
  busy on C effective cores, each is stretched by max(1, D / C). The threads come from the run's
  config (`resolve_placement`); C is fitted to the trace's own spans, those that overlap the
  other side's against those that ran alone, when the run overlapped; a run whose sides never
  overlapped (synchronous) leaves C at the run's cores. `--cores N` plans for a machine with N
  cores (C scaled by N / the run's cores). The replay applies the stretch by iterating: replay,
  measure each lane's mean stretch on the replayed timeline, replay with it, until it settles.

The replay assumes each side keeps the run's threads: a plan that `placement: auto` would give
other threads (synchronous gives each side every core) is best measured from a run placed the
same way (`--threads` in tools/bench_sync.py).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from tandem.common.sync import PRESETS, SyncPlan, preset_explorers

from .simulate import Gaps, Timeline, simulate
from .timeline import RunTimeline, Span, load_timeline

COMPUTE = ("train", "rollout")  # the spans that share the cores
_ROUNDS = 12  # replays to let the stretch settle (6-12 on bench_sync runs that stretch)


@dataclass
class Sharing:
    """How the trainer and the explorers share the machine's cores."""

    threads: dict[str, int]  # lane -> threads its compute uses
    cores: float  # effective cores: fitted to the trace when it overlapped, else run_cores
    run_cores: int  # cores of the machine the run had
    calibrated: bool = False  # cores fitted from overlapping spans

    def on(self, cores: int) -> Sharing:
        """The same sharing on a machine with `cores` cores."""
        if cores < 1:
            raise ValueError(f"--cores must be >= 1, got {cores}")
        return replace(self, cores=self.cores * cores / self.run_cores, run_cores=cores)

    def lanes(self, explorers: int) -> dict[str, int]:
        """Threads per lane for a plan with `explorers` explorers (each as the run's first)."""
        per = next((v for k, v in self.threads.items() if k != "trainer"), 1)
        return {"trainer": self.threads.get("trainer", 1),
                **{f"explorer-{i}": per for i in range(explorers)}}

    def to_json(self) -> dict[str, Any]:
        return {"threads": self.threads, "cores": round(self.cores, 3),
                "run_cores": self.run_cores, "calibrated": self.calibrated}


def _means(spans: list[tuple[str, float, float]], threads: dict[str, int],
           factor: Callable[[int], float]) -> list[float]:
    """Per span (lane, start, end): the mean over its time of factor(D), D being the threads
    of every lane with a compute span then (its own included; a lane whose spans overlap each
    other, a pipelining explorer, counts once)."""
    by_lane: dict[str, list[tuple[float, float]]] = {}
    for lane, start, end in spans:
        if end > start:
            by_lane.setdefault(lane, []).append((start, end))
    edges: list[tuple[float, int]] = []
    for lane, intervals in by_lane.items():
        k = threads.get(lane, 1)
        for start, end in _union_of(intervals):
            edges += [(start, k), (end, -k)]
    edges.sort()
    times: list[float] = []
    area: list[float] = []  # integral of factor(D) up to each edge
    after: list[float] = []  # factor(D) from each edge to the next
    demand = 0
    for at, delta in edges:
        area.append(area[-1] + (at - times[-1]) * after[-1] if times else 0.0)
        times.append(at)
        demand += delta
        after.append(factor(demand))

    def integral(x: float) -> float:
        i = bisect.bisect_right(times, x) - 1
        return area[i] + (x - times[i]) * after[i] if i >= 0 else 0.0

    return [(integral(end) - integral(start)) / (end - start) if end > start else factor(0)
            for _, start, end in spans]


def _union_of(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def stretches(spans: list[tuple[str, float, float]], threads: dict[str, int],
              cores: float) -> list[float]:
    """Per span (lane, start, end): how much the lanes running beside it stretch it, the mean
    over its time of max(1, D / cores)."""
    return _means(spans, threads, lambda demand: max(1.0, demand / cores))


@dataclass
class Durations:
    """Seconds per piece of work, as a run measured them."""

    explorers: list[str]
    rollout: list[float]  # per explorer, as it would run alone
    load: list[float]  # per explorer
    train: float  # as it would run alone
    publish: float
    steps: int  # trainer steps the run trained
    step_time: float  # the run's own wall-clock per trainer step
    gaps: Gaps = field(default_factory=Gaps)
    sharing: Sharing | None = None  # None: the sides never slow each other

    def to_json(self) -> dict[str, Any]:
        return {"explorers": self.explorers, "rollout": self.rollout, "load": self.load,
                "train": self.train, "publish": self.publish, "steps": self.steps,
                "step_time": self.step_time, "gaps": self.gaps.to_json(),
                "sharing": None if self.sharing is None else self.sharing.to_json()}

    def with_explorers(self, n: int, rollout_share: float = 1.0) -> Durations:
        """These durations for a plan with `n` explorers like the run's first, each rolling out
        `rollout_share` of its batch's work."""
        names = [f"explorer-{i}" for i in range(n)]
        return replace(self, explorers=names, rollout=[self.rollout[0] * rollout_share] * n,
                       load=[self.load[0]] * n)


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


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def measure_gaps(tl: RunTimeline, lease_ahead: bool = True) -> Gaps:
    """Mean seconds from a span's dependencies to its start, per kind (module docstring); each
    lane's first span is left out."""
    busy = ("rollout", "train", "sync", "eval")
    lanes = {name: sorted((s for s in tl.lane(name) if s.kind in busy), key=lambda s: s.start)
             for name in tl.explorers + ["trainer"]}
    trainer = lanes["trainer"]
    rollout_ends = sorted(s.end for e in tl.explorers for s in lanes[e] if s.kind == "rollout")
    per_step = max(1, len(tl.explorers))
    published = {s.version: s for s in trainer if s.kind == "sync"}
    sample, publish, load, after_load, after_rollout = [], [], [], [], []
    t = -1
    for i, s in enumerate(trainer):
        prev = trainer[i - 1] if i else None
        if s.kind == "train":
            t += 1
            need = per_step * (t + 1) - 1
            if t == 0 or prev is None or need >= len(rollout_ends):
                continue
            gap = s.start - max(prev.end, rollout_ends[need])
            if gap >= 0:
                sample.append(gap)
        elif s.kind == "sync" and prev is not None and prev.kind == "train" and t > 0:
            publish.append(s.start - prev.end)
    for e in tl.explorers:
        spans = lanes[e]
        for prev, s in itertools.pairwise(spans):
            if s.kind == "sync":
                source = published.get(s.version)
                if source is None:
                    continue
                ready = source.start if s.attrs.get("method") == "nccl" else source.end
                gap = s.start - max(prev.end, ready)
                if gap >= 0:
                    load.append(gap)
            elif s.kind == "rollout" and prev.kind in ("sync", "rollout"):
                (after_load if prev.kind == "sync" else after_rollout).append(s.start - prev.end)
    g_sample, g_load = _mean(sample) or 0.0, _mean(load) or 0.0
    g_after_load, g_after_rollout = _mean(after_load), _mean(after_rollout)
    if g_after_rollout is None:  # a synchronous run: every rollout follows a load
        g_after_rollout = (g_after_load or 0.0) + (0.0 if lease_ahead else g_sample)
    if g_after_load is None:
        g_after_load = g_after_rollout
    return Gaps(sample=g_sample, publish=_mean(publish) or 0.0, load=g_load,
                rollout=g_after_load, next_rollout=g_after_rollout)


def _broadcasts(tl: RunTimeline) -> list[float]:
    """Each nccl broadcast's seconds from the moment its last member joined to its end."""
    members: dict[int | None, list[Span]] = {}
    for s in tl.spans:
        if s.kind == "sync" and s.attrs.get("method") == "nccl":
            members.setdefault(s.version, []).append(s)
    return [max(m.end for m in ms) - max(m.start for m in ms)
            for _, ms in sorted(members.items(), key=lambda kv: min(m.start for m in kv[1]))
            if any(m.lane == "trainer" for m in ms)]


def fit_cores(tl: RunTimeline, threads: dict[str, int], run_cores: int) -> tuple[float, bool]:
    """The effective cores that best explain the compute spans' durations (each lane's spans
    after the first, as one alone-time per lane times their stretch), and whether the trace
    could tell: it can when some lane has spans that overlapped the other side's and spans
    that ran alone. Robust to a few slow spans: the fit minimises the spread of
    log(duration / stretch) about each lane's median."""
    spans = [s for s in tl.spans if s.kind in COMPUTE and s.end > s.start]
    keyed = [(s.lane, s.start, s.end) for s in spans]
    lanes = sorted({s.lane for s in spans})
    firsts = {min((i for i, s in enumerate(spans) if s.lane == lane),
                  key=lambda i: spans[i].start) for lane in lanes}
    keep = [i for i in range(len(spans)) if i not in firsts]
    exposure = _means(keyed, threads, float)  # mean threads busy during each span
    told = False
    for lane in lanes:
        own = threads.get(lane, 1)
        mine = [exposure[i] - own for i in keep if spans[i].lane == lane]
        told |= sum(x >= 0.5 for x in mine) >= 2 and sum(x < 0.5 for x in mine) >= 2
    if not told:
        return float(run_cores), False

    def spread(cores: float) -> float:
        factors = stretches(keyed, threads, cores)
        total = 0.0
        for lane in lanes:
            xs = [math.log((spans[i].end - spans[i].start) / factors[i])
                  for i in keep if spans[i].lane == lane]
            if xs:
                mid = statistics.median(xs)
                total += sum(abs(x - mid) for x in xs)
        return total

    demand = sum(threads.get(lane, 1) for lane in lanes)
    grid = [round(0.5 + 0.05 * k, 2) for k in range(int((demand - 0.5) / 0.05) + 1)]
    return min(reversed(grid), key=spread), True  # ties go to more cores (less stretch)
def _required(values: list[float], what: str, where: str) -> float:
    if not values:
        raise click.ClickException(f"{where}: the trace has no {what} spans to measure")
    return _typical(values)


def _run_threads(run_dir: Path, explorers: list[str]) -> tuple[dict[str, int], int, bool]:
    """Threads per lane, the run's cores and its explorers' lease_ahead, from its config.yaml
    (resolved as `placement` resolved it for the run). A run dir without a config, or whose
    config no longer loads here (its data moved): the threads it names, else one a lane, on
    this machine's cores, lease-ahead on."""
    import yaml

    from tandem.common.config import load_config
    from tandem.common.config.placement import machine_cores, resolve_placement
    from tandem.common.errors import TandemError

    path = run_dir / "config.yaml"
    try:
        config = load_config(path)
    except (OSError, TandemError):
        raw = (yaml.safe_load(path.read_text()) if path.is_file() else None) or {}
        place = raw.get("placement") or {}
        trainer = (place.get("trainer") or {}).get("threads") or 1
        explorer = (place.get("explorers") or {}).get("threads") or 1
        lease = all(e.get("lease_ahead", True) for e in raw.get("explorers") or [])
        return ({"trainer": trainer, **{e: explorer for e in explorers}},
                place.get("cores") or machine_cores(), lease)
    cores = config.placement.cores or machine_cores()
    table = resolve_placement(config, cores)
    trainer = table["trainer"]
    threads = {"trainer": (trainer.threads or cores) * trainer.nproc}
    for lane in explorers:
        threads[lane] = (table[lane].threads if lane in table else None) or cores
    return threads, cores, all(e.lease_ahead for e in config.explorers)


def measure(run_dir: str | Path, cores: int | None = None,
            stretch_from: str | Path | None = None) -> Durations:
    """The durations, gaps and sharing of `run_dir`'s trace (ClickException when it has none
    to measure); `cores`: plan for a machine with that many cores; `stretch_from`: fit the
    sharing to that run's trace instead (one whose sides overlapped, on the same machine)."""
    tl: RunTimeline = load_timeline(run_dir)
    where = str(run_dir)
    # lanes that roll out: the buffer's sample waits are a lane of the timeline too
    tl = replace(tl, explorers=[e for e in tl.explorers
                                if any(s.kind == "rollout" for s in tl.lane(e))])
    if not tl.explorers:
        raise click.ClickException(f"{where}: the trace has no explorer lane")
    threads, run_cores, lease_ahead = _run_threads(Path(run_dir), tl.explorers)
    fitted, told = fit_cores(tl, threads, run_cores)
    sharing = Sharing(threads, fitted, run_cores, told)
    if stretch_from is not None:
        other = measure(stretch_from).sharing
        assert other is not None
        sharing = replace(sharing, cores=other.cores * run_cores / other.run_cores,
                          calibrated=other.calibrated)
        fitted = sharing.cores
    compute = [s for s in tl.spans if s.kind in COMPUTE]
    factors = dict(zip(map(id, compute), stretches([(s.lane, s.start, s.end) for s in compute],
                                                   threads, fitted)))

    def spans(lane: str, kind: str, alone: bool = False) -> list[float]:
        return [(s.end - s.start) / (factors[id(s)] if alone else 1.0)
                for s in sorted(tl.lane(lane), key=lambda s: s.start) if s.kind == kind]

    trains = spans("trainer", "train", alone=True)
    broadcasts = _broadcasts(tl)
    d = Durations(
        explorers=tl.explorers,
        rollout=[_required(spans(e, "rollout", alone=True), f"{e} rollout", where)
                 for e in tl.explorers],
        load=[_typical(spans(e, "sync")) for e in tl.explorers],
        train=_required(trains, "trainer train", where),
        publish=_typical(broadcasts) if broadcasts else _typical(spans("trainer", "sync")),
        steps=len(trains),
        step_time=tl.makespan / len(trains),
        gaps=measure_gaps(tl, lease_ahead), sharing=sharing)
    return d if cores is None else replace(d, sharing=sharing.on(cores))


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


def _lane_stretch(timeline: Timeline, threads: dict[str, int], cores: float) -> dict[str, float]:
    """Each lane's mean stretch over its compute blocks, weighted by their time, leaving out
    its first and last block when it has more (the replay's start and end, where one side
    runs alone while the other fills or drains, are not the steady state)."""
    blocks = [b for b in timeline.blocks if b.kind in COMPUTE]
    factors = stretches([(b.lane, b.start, b.end) for b in blocks], threads, cores)
    by_lane: dict[str, list[tuple[float, float]]] = {}
    for b, f in sorted(zip(blocks, factors), key=lambda bf: bf[0].start):
        by_lane.setdefault(b.lane, []).append((b.end - b.start, f))
    out = {}
    for lane, rows in by_lane.items():
        steady = rows[1:-1] if len(rows) > 2 else rows
        busy = sum(t for t, _ in steady)
        if busy > 0:
            out[lane] = sum(t * f for t, f in steady) / busy
    return out


def predict(d: Durations, name: str, plan: SyncPlan, steps: int | None = None) -> Prediction:
    """Replay `plan` over `d`; with `d.sharing`, each side's spans stretched by the other's
    (replayed until each lane's stretch settles)."""
    steps = steps or max(d.steps, 1)
    lanes = [f"explorer-{i}" for i in range(len(d.rollout))]
    stretch = {lane: 1.0 for lane in lanes + ["trainer"]}
    timeline = None
    for _ in range(_ROUNDS if d.sharing is not None else 1):
        timeline = simulate(plan, steps=steps, rollout_times=[r * stretch[lane] for r, lane
                                                              in zip(d.rollout, lanes)],
                            train_time=d.train * stretch["trainer"], sync_time=d.publish,
                            load_times=d.load, compare=False, gaps=d.gaps)
        if d.sharing is None:
            break
        seen = _lane_stretch(timeline, d.sharing.lanes(len(lanes)), d.sharing.cores)
        settled = all(abs(seen.get(k, 1.0) - v) < 1e-3 for k, v in stretch.items())
        stretch = {k: (v + seen.get(k, 1.0)) / 2 for k, v in stretch.items()}  # damped
        if settled:
            break
    assert timeline is not None
    return Prediction(name, plan, timeline, steps)


def replay_assumed(plan: SyncPlan, *, steps: int, rollout_times: list[float], train_time: float,
                   sync_time: float, gap: float = 0.0, cores: int | None = None,
                   threads: tuple[int, int] = (1, 1)) -> Timeline:
    """`tandem plan` without a run: `plan` over assumed durations, every kind of gap `gap`
    seconds, the sides stretched on `cores` cores (None: never) with `threads` (trainer, each
    explorer); the timeline carries its speedup over the synchronous preset's replay."""
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    n = len(rollout_times)
    lanes = [f"explorer-{i}" for i in range(n)]
    sharing = None if cores is None else Sharing(
        {"trainer": threads[0], **{lane: threads[1] for lane in lanes}}, float(cores), cores)
    d = Durations(explorers=lanes, rollout=list(rollout_times), load=[sync_time] * n,
                  train=train_time, publish=sync_time, steps=steps, step_time=0.0,
                  gaps=Gaps(sample=gap, publish=gap, load=gap, rollout=gap, next_rollout=gap),
                  sharing=sharing)
    timeline = predict(d, "plan", plan, steps).timeline
    base = predict(d, "synchronous", SyncPlan.preset("synchronous", batches_per_step=n), steps)
    timeline.speedup_vs_synchronous = base.timeline.makespan / timeline.makespan
    return timeline


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


def rank(d: Durations, max_staleness: int, steps: int | None = None) -> list[Prediction]:
    """Every candidate whose replayed staleness never exceeds `max_staleness`, the shortest
    predicted step first (ties go to the fresher, then the simpler plan)."""
    ranked: list[tuple[tuple, Prediction]] = []
    for plan in candidates(max_staleness, len(d.rollout)):
        try:
            p = predict(d, "advised", plan, steps)
        except (ValueError, RuntimeError):  # knobs the rules refuse, or a deadlocked plan
            continue
        mean, worst = p.staleness()
        if worst > max_staleness:
            continue
        key = (round(p.step_time, 6), mean, plan.interval, plan.offset is None)
        ranked.append((key, p))
    if not ranked:
        raise click.ClickException(f"no knobs keep staleness within {max_staleness}")
    ranked.sort(key=lambda kp: kp[0])
    return [p for _, p in ranked]


def advise(d: Durations, own: Prediction, max_staleness: int,
           steps: int | None = None) -> Prediction:
    """The knobs with the shortest predicted step time whose replayed staleness never exceeds
    `max_staleness` (`rank`'s first)."""
    return rank(d, max_staleness, steps)[0]


def knobs_text(plan: SyncPlan) -> str:
    offset = "null" if plan.offset is None else plan.offset
    return (f"{plan.method} interval {plan.interval} offset {offset} "
            f"max_staleness {plan.max_staleness}")


def print_report(d: Durations, predictions: list[Prediction], advice: Prediction | None,
                 own: Prediction, bound: int | None,
                 runners_up: list[Prediction] | None = None) -> None:
    echo = click.echo
    rollouts = ", ".join(f"{n} {r:.3f}s (load {x:.3f}s)"
                         for n, r, x in zip(d.explorers, d.rollout, d.load))
    echo(f"measured: rollout {rollouts}; train {d.train:.3f}s; publish {d.publish:.3f}s; "
         f"{d.steps} steps at {d.step_time:.3f}s each")
    g = d.gaps
    echo(f"gaps: sample {g.sample:.3f}s, publish {g.publish:.3f}s, load {g.load:.3f}s, rollout "
         f"after a load {g.rollout:.3f}s, after a rollout {g.next_rollout:+.3f}s")
    if d.sharing is not None:
        s = d.sharing
        threads = ", ".join(f"{lane} {n}" for lane, n in s.threads.items())
        echo(f"cores: {s.run_cores}, behaving as {s.cores:.2f} for the sides "
             f"({'fitted to overlapping spans' if s.calibrated else 'no overlap to fit: taken as is'}"
             f"); threads: {threads}")
    header = (f"{'plan':<22} {'knobs':<50} {'step s':>7} {'trainer':>8} {'explorers':>10} "
              f"{'stale mean/max':>15}")
    echo(header)
    echo("-" * len(header))
    for p in predictions + ([advice] if advice is not None else []) + (runners_up or []):
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
