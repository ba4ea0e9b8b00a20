"""`tandem plan`: replay a SyncPlan over assumed durations, before any GPU is spent.

The simulator applies the same `SyncPlan` the master applies to live counters: an explorer step
starts when `SyncPlan.decide` lets it, a trainer step when its batches are in the buffer, a
publish when `SyncPlan.publish_after` asks for one. nccl syncs are collectives (trainer and every
explorer in one block, started when the last of them arrives); checkpoint syncs are a write on
the trainer lane and a load on each explorer lane, each on its own time.

`Gaps` are the seconds a real run spends between a span's dependencies and its start (the
buffer's sample and ack before a train step, the master's barrier, the broadcast rendezvous):
each block starts that long after the last thing it waits for. `tandem plan --from` measures
them per kind from a run's trace (`plan_from.measure_gaps`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.common.sync import SyncPlan

INF = math.inf


@dataclass(frozen=True)
class Gaps:
    """Seconds between a block's dependencies and its start, per kind of block."""

    sample: float = 0.0  # a train step after its batches are complete and the trainer is free
    publish: float = 0.0  # a publish (checkpoint write, or broadcast) after its train step
    load: float = 0.0  # an explorer's load, or its joining a broadcast, after the version exists
    rollout: float = 0.0  # a rollout after the explorer's load or broadcast
    # a rollout after the explorer's previous rollout; negative when the explorer starts the
    # next step before the previous one's span ends (lease-ahead: its batch is still going out)
    next_rollout: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not v >= 0 and k != "next_rollout"}
        if bad or not math.isfinite(self.next_rollout):
            raise ValueError(f"gaps must be >= 0 seconds (next_rollout: finite), got "
                             f"{bad or {'next_rollout': self.next_rollout}}")

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in vars(self).items()}


@dataclass
class Block:
    """One coloured block of the timeline."""

    lane: str  # "explorer-<i>" or "trainer"
    kind: str  # rollout | train | sync
    start: float
    end: float
    step: int | None = None
    version: int | None = None
    method: str | None = None
    batch: int | None = None
    batches: list[int] = field(default_factory=list)


@dataclass
class Timeline:
    """What the simulator produced, plus the summary figures `tandem plan` prints."""

    plan: SyncPlan
    explorers: int
    blocks: list[Block]
    buffer: list[tuple[float, int]]  # (time, complete batches the trainer has not acked)
    makespan: float
    speedup_vs_synchronous: float | None = None

    def lane(self, name: str, kind: str | None = None) -> list[Block]:
        return [b for b in self.blocks if b.lane == name and (kind is None or b.kind == kind)]

    def utilization(self) -> dict[str, Any]:
        def busy(lane: str, kind: str) -> float:
            total = sum(b.end - b.start for b in self.lane(lane, kind))
            return round(total / self.makespan, 4) if self.makespan > 0 else 0.0
        return {"trainer": busy("trainer", "train"),
                "explorers": [busy(f"explorer-{i}", "rollout") for i in range(self.explorers)]}

    def to_json(self) -> dict[str, Any]:
        explorers = [[dict(step=b.step, batch=b.batch, start=_r(b.start), end=_r(b.end),
                           version=b.version) for b in self.lane(f"explorer-{i}", "rollout")]
                     for i in range(self.explorers)]
        trainer = [dict(step=b.step, start=_r(b.start), end=_r(b.end), batches=b.batches)
                   for b in self.lane("trainer", "train")]
        syncs = [dict(version=b.version, start=_r(b.start), end=_r(b.end), method=b.method,
                      lane=b.lane) for b in sorted(self.blocks, key=lambda b: (b.start, b.lane))
                 if b.kind == "sync"]
        return {"plan": self.plan.describe(), "explorers": explorers, "trainer": trainer,
                "syncs": syncs, "buffer": [dict(time=_r(t), batches=n) for t, n in self.buffer],
                "makespan": _r(self.makespan), "utilization": self.utilization(),
                "speedup_vs_synchronous": (None if self.speedup_vs_synchronous is None
                                           else round(self.speedup_vs_synchronous, 4))}


def _r(x: float) -> float:
    return round(x, 6)


@dataclass
class _Explorer:
    index: int
    rollout: float
    load: float = 0.0  # seconds to load a checkpoint version
    free: float = 0.0
    step: int = 0  # next step (synchronous plans)
    held: int | None = None
    since_load: int = 0
    waiting_broadcast: int | None = None
    last: str | None = None  # kind of its previous block: sync | rollout
    last_start: float = 0.0  # its previous rollout's start

    @property
    def lane(self) -> str:
        return f"explorer-{self.index}"


@dataclass
class _Batch:
    batch: int
    step: int
    explorer: int
    end: float
    consumed: bool = False


class Simulator:
    """Replays `plan` for `steps` trainer steps with the given durations (seconds)."""

    def __init__(self, plan: SyncPlan, *, steps: int, rollout_times: list[float],
                 train_time: float, sync_time: float = 0.0,
                 load_times: list[float] | None = None, gaps: Gaps | None = None):
        """`sync_time` is the trainer's publish (checkpoint write, or the nccl broadcast all
        lanes share); `load_times`, per explorer, a checkpoint load (default `sync_time`);
        `gaps`, the time each kind of block starts after what it waits for (default none)."""
        if steps < 1:
            raise ValueError(f"--steps must be >= 1, got {steps}")
        if not rollout_times or any(r <= 0 for r in rollout_times):
            raise ValueError(f"rollout times must be > 0, got {rollout_times}")
        if train_time <= 0 or sync_time < 0:
            raise ValueError("train time must be > 0 and sync time >= 0")
        loads = [sync_time] * len(rollout_times) if load_times is None else load_times
        if len(loads) != len(rollout_times) or any(x < 0 for x in loads):
            raise ValueError(f"need one load time >= 0 per explorer, got {loads}")
        self.plan = plan
        self.gaps = gaps or Gaps()
        self.steps = steps
        self.train_time = train_time
        self.sync_time = sync_time
        self.explorers = [_Explorer(i, r, load) for i, (r, load)
                          in enumerate(zip(rollout_times, loads))]
        self.blocks: list[Block] = []
        self.batches: list[_Batch] = []
        self.published: dict[int, float] = {0: 0.0}  # version -> time explorers may use it
        self._pub_order: list[tuple[int, float]] = [(0, 0.0)]  # ascending in version and time
        self.unconsumed: list[_Batch] = []
        self.consumed_at: list[tuple[float, int]] = []

    def run(self) -> Timeline:
        if self.plan.asynchronous:
            self._run_async()
        else:
            self._run_sync()
        makespan = max(b.end for b in self.blocks)
        return Timeline(self.plan, len(self.explorers), self.blocks, self._buffer_levels(),
                        makespan)

    # -- synchronous plans: explorers count their own steps, trainer step t trains on round t --

    def _run_sync(self) -> None:
        plan, n = self.plan, len(self.explorers)
        trainer_free, t = 0.0, 0
        broadcast: dict[int, float] = {}  # version -> time the trainer is ready to broadcast it
        ends: dict[tuple[int, int], float] = {}
        while True:
            progressed = False
            for ex in self.explorers:
                while ex.step < self.steps and ex.waiting_broadcast is None:
                    e = ex.step
                    if plan.is_sync_point(e) and plan.method == "nccl":
                        ex.waiting_broadcast = plan.version_for_step(e)
                        break
                    go = plan.decide(e, newest=self._newest(), held=ex.held)
                    if go is None:
                        break
                    start = ex.free
                    if go.load:
                        start = max(start, self.published[go.version]) + self.gaps.load
                        self._add("sync", ex.lane, start, start + ex.load,
                                  version=go.version, method="checkpoint")
                        start += ex.load
                    start = self._after_gap(ex, start)
                    self._rollout(ex, e, e * n + ex.index, go.version, start)
                    ends[(e, ex.index)] = ex.free
                    progressed = True
            for v, ready in list(broadcast.items()):
                waiting = [ex for ex in self.explorers if ex.waiting_broadcast == v]
                if len(waiting) == n:
                    start = max([ready] + [ex.free for ex in waiting]) + self.gaps.load
                    end = start + self.sync_time
                    self.published[v] = start
                    for lane in ["trainer"] + [ex.lane for ex in waiting]:
                        self._add("sync", lane, start, end, version=v, method="nccl")
                    for ex in waiting:
                        e = ex.step
                        ex.free, ex.held, ex.waiting_broadcast = end, v, None
                        ex.last = "sync"
                        self._rollout(ex, e, e * n + ex.index, v, end + self.gaps.rollout)
                        ends[(e, ex.index)] = ex.free
                    trainer_free = end
                    del broadcast[v]
                    progressed = True
            if t < self.steps and not broadcast and all((t, i) in ends for i in range(n)):
                start = max([trainer_free] + [ends[(t, i)] for i in range(n)]) + self.gaps.sample
                trainer_free = self._train(t, start, [t * n + i for i in range(n)])
                version = plan.publish_after(t, self.steps)
                if version is not None:
                    if plan.method == "nccl":
                        broadcast[version] = trainer_free + self.gaps.publish
                    else:
                        trainer_free = self._write(version, trainer_free + self.gaps.publish)
                t += 1
                progressed = True
            if t >= self.steps and all(ex.step >= self.steps for ex in self.explorers):
                return
            if not progressed:
                raise RuntimeError(f"plan deadlocked at trainer step {t}: {plan.describe()}")

    # -- asynchronous plans: batches numbered globally, the trainer takes the oldest complete --

    def _run_async(self) -> None:
        plan = self.plan
        per_step = plan.batches_per_step
        total = self.steps * per_step
        trainer_free, t, next_batch = 0.0, 0, 0
        while t < self.steps or next_batch < total:
            candidates: list[tuple[float, int, Any]] = []
            if next_batch < total:
                need = plan.min_version(plan.step_of_batch(next_batch))
                i = bisect.bisect_left(self._pub_order, (need, -INF))
                ready = self._pub_order[i][1] if i < len(self._pub_order) else INF
                for ex in self.explorers:
                    candidates.append((max(ex.free, ready), 1 + ex.index, ex))
            if t < self.steps and len(self.unconsumed) >= per_step:
                waiting = sorted(b.end for b in self.unconsumed)
                candidates.append((max(trainer_free, waiting[per_step - 1]) + self.gaps.sample,
                                   0, None))
            start, _, ex = min(candidates, key=lambda c: (c[0], c[1]))
            if start == INF:
                raise RuntimeError(f"plan deadlocked at trainer step {t}: {plan.describe()}")
            if ex is None:
                done = sorted((b for b in self.unconsumed if b.end <= start),
                              key=lambda b: (b.end, b.batch))[:per_step]
                for b in done:
                    b.consumed = True
                self.unconsumed = [b for b in self.unconsumed if not b.consumed]
                trainer_free = self._train(t, start, [b.batch for b in done])
                version = plan.publish_after(t, self.steps)
                if version is not None:
                    trainer_free = self._write(version, trainer_free + self.gaps.publish)
                t += 1
                continue
            step = plan.step_of_batch(next_batch)
            times = [at for _, at in self._pub_order]
            newest = self._pub_order[bisect.bisect_right(times, start) - 1][0]
            go = plan.decide(step, newest=newest, held=ex.held, since_load=ex.since_load)
            assert go is not None, "the staleness bound was checked when choosing the start"
            if go.load:
                start += self.gaps.load
                self._add("sync", ex.lane, start, start + ex.load, version=go.version,
                          method="checkpoint")
                start += ex.load
                ex.since_load = 0
                ex.last = "sync"
            start = self._after_gap(ex, start)
            ex.free = start
            self._rollout(ex, step, next_batch, go.version, start, count_step=False)
            ex.since_load += 1
            next_batch += 1

    # -- shared pieces ------------------------------------------------------------------------

    def _newest(self) -> int:
        return max(self.published)

    def _after_gap(self, ex: _Explorer, ready: float) -> float:
        """When `ex`'s next rollout starts, given it could from `ready`: no gap before its
        first, one kind after a load and another after a rollout, never before the previous
        rollout's start."""
        gap = {"sync": self.gaps.rollout, "rollout": self.gaps.next_rollout}.get(ex.last, 0.0)
        return max(ready + gap, ex.last_start)

    def _rollout(self, ex: _Explorer, step: int, batch: int, version: int, start: float,
                 count_step: bool = True) -> None:
        ex.last, ex.last_start = "rollout", start
        end = start + ex.rollout
        self._add("rollout", ex.lane, start, end, step=step, version=version, batch=batch)
        self.batches.append(_Batch(batch, step, ex.index, end))
        self.unconsumed.append(self.batches[-1])
        ex.free, ex.held = end, version
        if count_step:
            ex.step += 1

    def _train(self, t: int, start: float, batches: list[int]) -> float:
        end = start + self.train_time
        self._add("train", "trainer", start, end, step=t, version=t + 1, batches=batches)
        self.consumed_at.append((end, len(batches)))  # acked, so gone from the buffer
        return end

    def _write(self, version: int, start: float) -> float:
        end = start + self.sync_time
        self._add("sync", "trainer", start, end, version=version, method="checkpoint")
        self.published[version] = end
        self._pub_order.append((version, end))
        return end

    def _add(self, kind: str, lane: str, start: float, end: float, **attrs: Any) -> None:
        if kind == "sync" and end <= start:
            return  # a zero-time sync is not drawn
        self.blocks.append(Block(lane=lane, kind=kind, start=start, end=end, **attrs))

    def _buffer_levels(self) -> list[tuple[float, int]]:
        changes = [(b.end, 1) for b in self.batches] + [(at, -n) for at, n in self.consumed_at]
        level, out = 0, []
        for at, delta in sorted(changes, key=lambda c: (c[0], -c[1])):
            level += delta
            if out and out[-1][0] == at:
                out[-1] = (at, level)
            else:
                out.append((at, level))
        return out


def simulate(plan: SyncPlan, *, steps: int, rollout_times: list[float], train_time: float,
             sync_time: float = 0.0, compare: bool = True,
             load_times: list[float] | None = None, gaps: Gaps | None = None) -> Timeline:
    """Replay `plan`; with `compare`, also the synchronous preset, for the speedup."""
    timeline = Simulator(plan, steps=steps, rollout_times=rollout_times, train_time=train_time,
                         sync_time=sync_time, load_times=load_times, gaps=gaps).run()
    if compare:
        baseline = Simulator(SyncPlan.preset("synchronous", batches_per_step=len(rollout_times)),
                             steps=steps, rollout_times=rollout_times, train_time=train_time,
                             sync_time=sync_time, load_times=load_times, gaps=gaps).run()
        timeline.speedup_vs_synchronous = baseline.makespan / timeline.makespan
    return timeline
