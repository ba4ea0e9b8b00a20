"""The run's clock: `SyncPlan` applied to live counters, with no sockets.

Inputs are the nine things that happen in a run: an explorer joins, an explorer leaves (or is
declared dead), the taskset runs dry on an explorer, an explorer's step drains (asynchronous
plans), an explorer finishes a step, the trainer finishes a step, the trainer (re)starts from a
checkpoint, a version is published, the master restarts (no barrier is granted until the
trainer shows which lineage goes on). A batch is counted once: a report of one already counted
changes nothing, whatever restarted in between.
Each input returns the decisions it unlocks, as (topic, message) pairs for the master's PUB
socket. The clock is deterministic, so the master journals inputs only and a restarted master
replays them to the same state, decisions and sequence numbers included.

Several explorers (see `tandem.common.sync`): in synchronous plans an explorer is a member of
every step from the one it joined at, trainer step `t` may start once every member alive (and
every member that left after finishing `t`) has its batch `t` in the buffer. In asynchronous
plans batches are numbered as they are granted and trainer step `t` may start once
`(t + 1) * batches_per_step` batches are complete.

Streaming across steps (asynchronous plans): an explorer holds at most two batches, `running`
and `ahead`. When its running batch drains (`explorer_draining`: all its tasks leased, a slot
free), it is granted the next batch at once, by the same rule as any grant (the total, the
staleness bound on the newest version, a load every `interval` batches, counting the running
batch as rolled out), so it leases and rolls out the next step while the last groups of this
one finish and no step boundary idles its engine. The batch ahead is never of the running one's
step (task leases are per explorer and step): with several batches per step it waits until
another explorer takes the rest of that step. Reports come in grant order: when the running
batch is reported, the one ahead becomes the running one. An explorer that dies (or restarts)
loses both (a restart redoes the running one); a taskset that runs dry on the batch ahead loses
only that one, and the running one still reports. The grant is made at the notice, not at the
report, so its version is the newest published then; each group still counts its staleness by
the version that generated it.

Dynamic sampling (`trainer.dynamic_sampling`): explorers report how many of a batch's groups are
informative (rewards not all equal). In synchronous plans, when step `t` has all its batches but
fewer than `top_up_target` informative groups, an idle explorer is granted one more batch for
step `t` (a top-up: new tasks, a new batch number), up to `max_extra` per step. In asynchronous
plans completed batches are taken in the order they completed: step `t` takes the
`batches_per_step` after the previous step's, then one more at a time while it is short of
`top_up_target` informative groups, up to `max_extra` more. Explorers keep producing, so the
extra batches are mostly ones already rolled out for later steps; only when none is on the way
does an idle explorer get a top-up for `t`. Once a step is released, its extra batches shift the
numbering: a batch granted after it is labelled with the step that will train it (the released
steps' extra batches are not counted when its number maps to a step), so the staleness bound is
that step's, and the plan's total grows by them. Either way the trainer's `TrainerGo` counts every
group of the step, informative or not, so the buffer hands it all of them and the trainer
consumes (acks) all while training only the informative ones.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import PlainSerializer

from tandem.common.messages.master import (
    Barrier,
    ExplorerStatus,
    RunningStep,
    Stop,
    TrainerGo,
    barrier_topic,
)
from tandem.common.sync import SyncPlan

Decision = tuple[str, Any]  # (topic, message)


class StepMismatch(ValueError):
    """An explorer reported a step the master did not grant it."""


class DeclaredDead(StepMismatch):
    """An explorer the master declared dead reported a step: it must register again, and its
    batch's tasks were leased out again."""


@dataclass
class ExplorerSlot:
    name: str
    join_step: int
    alive: bool = True
    finished: bool = False  # the taskset ran dry on it: it gets no more steps
    next_step: int | None = None  # synchronous: the step it waits to start
    redo: tuple[int, int] | None = None  # (step, batch) granted before it restarted
    running: tuple[int, int, int] | None = None  # (step, batch, version) granted, not done
    # asynchronous: the next batch, granted while `running` drains, and its barrier
    ahead: tuple[int, int, int] | None = None
    ahead_barrier: Barrier | None = None
    draining: bool = False  # `running` has all its tasks leased and a slot free
    last_done: tuple[int, int] | None = None
    held: int | None = None
    since_load: int = 0
    steps_done: int = 0
    barrier: Barrier | None = None

    def describe(self, newest: int, trained: int) -> ExplorerStatus:
        return ExplorerStatus(
            name=self.name, alive=self.alive, finished=self.finished, join_step=self.join_step,
            running=None if self.running is None else RunningStep(
                step=self.running[0], batch=self.running[1], version=self.running[2]),
            ahead=None if self.ahead is None else RunningStep(
                step=self.ahead[0], batch=self.ahead[1], version=self.ahead[2]),
            steps_done=self.steps_done, held_version=self.held,
            staleness=None if self.held is None else trained - self.held,
            behind_newest=None if self.held is None else newest - self.held)


# A set in the journal's snapshot (`snapshot.capture`) is written sorted: a set iterates in an
# order that depends on the process's hash seed and on the order its members came in, so written
# as it iterates, the same state would give a different snapshot in each process.
Names = Annotated[set[str], PlainSerializer(sorted, return_type=list[str])]
Steps = Annotated[set[int], PlainSerializer(sorted, return_type=list[int])]


@dataclass
class RunClock:
    plan: SyncPlan
    total_steps: int
    explorers: dict[str, ExplorerSlot] = field(default_factory=dict)
    done: dict[int, Names] = field(default_factory=dict)  # synchronous: step -> explorers
    groups: dict[int, int] = field(default_factory=dict)  # synchronous: step -> tasks done
    completed_groups: list[int | None] = field(default_factory=list)  # per batch, in order
    completed_informative: list[int | None] = field(default_factory=list)  # per batch, in order
    batches_granted: int = 0
    batches_lost: int = 0
    batches_done: int = 0
    trainer_done: int = 0  # trainer steps finished = version trained
    trainer_go: int = 0  # trainer steps released
    newest: int = 0  # newest published version
    published_versions: list[int] = field(default_factory=list)  # in the trainer's lineage
    broadcast_through: int = 0  # nccl: versions a lost lineage broadcast; never broadcast again
    on_disk: Steps = field(default_factory=set)  # nccl: versions a resumed trainer wrote
    stopped: bool = False
    exhausted: bool = False  # the taskset ran dry
    last_go: TrainerGo | None = None
    stop: Stop | None = None
    published_count: Counter = field(default_factory=Counter)  # decisions per topic
    top_up_target: int | None = None  # dynamic sampling: informative groups a step wants
    colocated: str | None = None  # placement.colocate: the explorer whose engine sleeps
    colocated_sleeps_last: bool = True  # ... after the last step too (no final evaluation)
    max_extra: int = 0  # dynamic sampling: top-up batches one step may get
    informative: dict[int, int] = field(default_factory=dict)  # synchronous: step -> groups
    uncounted: Steps = field(default_factory=set)  # steps with a batch of unknown signal
    extra: dict[int, int] = field(default_factory=dict)  # step -> top-up batches granted
    # asynchronous: step -> (first, count) of the completed batches it trains on, fixed once
    # released (a resumed trainer is released on the same ones)
    windows: dict[int, tuple[int, int]] = field(default_factory=dict)
    # batch -> (explorer, step) of every batch counted done, and each explorer's newest: a
    # step is reported once. A restarted explorer learns its newest at registration and skips
    # barriers up to it (a snapshot can replay the barrier of a batch it reported); a report of
    # a counted batch again is answered without counting it, whatever became of its slot since
    reported: dict[int, tuple[str, int]] = field(default_factory=dict)
    newest_reported: dict[str, int] = field(default_factory=dict)
    # a restarted master grants no barrier until the trainer shows which lineage goes on: a
    # trainer resumed from an older checkpoint moves the newer versions aside, and a grant
    # made from the journal's `newest` named a version that was gone (issue 32 item 5)
    awaiting_trainer: bool = False
    # Bounded memory: the trainer resumes only from a checkpoint it keeps (the newest
    # `keep_checkpoints` reported), so the steps before the oldest of them are never released,
    # granted or reported again. Their per-step and per-batch entries above are dropped
    # (`checkpointed`); what later questions still need of them is kept as totals: how many
    # completed batches and extra batches they took (asynchronous numbering), and for a stale
    # report of one of their batches, the explorer's newest report (`is_reported`).
    keep_checkpoints: int = 2
    checkpoints: list[int] = field(default_factory=list)  # the newest reported, oldest first
    forgotten_through: int = 0  # steps before it are forgotten
    completed_base: int = 0  # completed batches dropped from the head of completed_groups
    forgotten_extra: int = 0  # extra batches of the forgotten steps

    # -- inputs --------------------------------------------------------------------------------

    def join(self, name: str, *, stored: bool = False, groups: int | None = None,
             informative: int | None = None) -> list[Decision]:
        """An explorer registers: first time, after it was declared dead, or after a restart.
        `stored`: the batch it was running is in the buffer and its tasks completed (only its
        report was lost), so it counts as done instead of being redone."""
        slot = self.explorers.get(name)
        if slot is not None and slot.alive:
            if stored and slot.running is not None:
                self._finish(slot, slot.running[2], groups, informative)
            # it restarted faster than its liveness ran out: it redoes what it was granted;
            # a batch granted ahead is lost (its lease goes back when it expires)
            if slot.running is not None:
                slot.redo = slot.running[:2]
                slot.running = None
            self._lose_ahead(slot)
            slot.held, slot.since_load, slot.barrier = None, 0, None
            return self._release()
        start = self._join_step()
        self.explorers[name] = ExplorerSlot(name, join_step=start, next_step=start)
        return self._release()

    def leave(self, name: str, *, stored: bool = False, groups: int | None = None,
              informative: int | None = None) -> list[Decision]:
        """An explorer is gone (declared dead, or deregistered); its unfinished batch is lost
        (its tasks are leased again), unless `stored`: in the buffer with its tasks completed,
        only the report missing, it counts as done."""
        slot = self.explorers.get(name)
        if slot is None or not slot.alive:
            return []
        slot.alive = False
        self._lose_ahead(slot)  # granted ahead: never reported before the running batch
        if stored and slot.running is not None:
            self._finish(slot, slot.running[2], groups, informative)
        elif slot.running is not None or slot.redo is not None:
            self.batches_lost += 1
        slot.running = slot.redo = None
        return self._release()

    def tasks_exhausted(self, name: str) -> list[Decision]:
        """The taskset had nothing left for `name`'s granted step: that batch will never come,
        and the explorer gets no more steps. Once no explorer can produce anything, the trainer
        finishes the steps that are complete and the run stops."""
        self.exhausted = True
        slot = self.explorers.get(name)
        if slot is not None and slot.alive and not slot.finished:
            slot.finished = True
            if slot.ahead is not None:
                # the batch granted ahead found nothing; the one draining still reports
                self._lose_ahead(slot)
                return self._release()
            if slot.running is not None or slot.redo is not None:
                self.batches_lost += 1
            slot.running = slot.redo = None
        return self._release()

    def explorer_done(self, name: str, step: int, batch: int | None, version: int,
                      groups: int | None = None, informative: int | None = None
                      ) -> list[Decision]:
        if self.is_reported(name, step, batch):
            return []  # a repeat of a report already counted (even by an earlier slot)
        slot = self.explorers.get(name)
        if slot is None:
            raise StepMismatch(f"{name} is not registered with the master; register first")
        if not slot.alive:
            raise DeclaredDead(f"{name} was declared dead (silent past transport.liveness) and "
                               "its batch was given up; register again to get a new step")
        if slot.last_done is not None and slot.last_done[0] == step and (
                batch is None or slot.last_done[1] == batch):
            return []  # a repeat of a report already counted
        if slot.running is None or slot.running[0] != step or (
                batch is not None and slot.running[1] != batch):
            granted = "nothing" if slot.running is None else (
                f"step {slot.running[0]} batch {slot.running[1]}")
            raise StepMismatch(f"{name} reported step {step} batch {batch} but was granted "
                               f"{granted}")
        self._finish(slot, version, groups, informative)
        return self._release()

    def is_reported(self, name: str, step: int, batch: int | None) -> bool:
        """`name` already reported `batch` of `step`: it was counted, and is never again."""
        if batch is None:
            return False
        if step < self.forgotten_through:  # trained and checkpointed: a report is a repeat
            return self.newest_reported.get(name, -1) >= batch
        return self.reported.get(batch) == (name, step)

    def holds(self, name: str) -> tuple[tuple[int, int, int] | None, int | None]:
        """What `name` holds as the master counts it: the batch granted and not reported, as
        (step, batch, version), and the newest batch it reported (a barrier up to it is
        stale)."""
        slot = self.explorers.get(name)
        running = slot.running if slot is not None and slot.alive else None
        return running, self.newest_reported.get(name)

    def explorer_draining(self, name: str, step: int, batch: int) -> list[Decision]:
        """Asynchronous plans: `name`'s running batch has all its tasks leased and a slot free.
        It is granted its next batch now (under the same limits as any grant), to start while
        this one drains. A notice for a batch no longer running (reported meanwhile, or lost)
        changes nothing."""
        slot = self.explorers.get(name)
        if (not self.plan.asynchronous or slot is None or not slot.alive
                or slot.running is None or slot.running[:2] != (step, batch)):
            return []
        slot.draining = True
        return self._release()

    def _lose_ahead(self, slot: ExplorerSlot) -> None:
        if slot.ahead is not None:
            self.batches_lost += 1
        slot.ahead, slot.ahead_barrier, slot.draining = None, None, False

    def _finish(self, slot: ExplorerSlot, version: int, groups: int | None,
                informative: int | None = None) -> None:
        """Count `slot`'s running batch as done (in the buffer, rolled out with `version`)."""
        step, batch, _ = slot.running
        slot.running, slot.last_done = None, (step, batch)
        self.reported[batch] = (slot.name, step)
        self.newest_reported[slot.name] = max(batch, self.newest_reported.get(slot.name, batch))
        slot.steps_done += 1
        slot.since_load += 1
        if slot.ahead is None:
            slot.held = version
        else:  # the batch granted ahead runs now, with the weights it was granted
            slot.running, slot.barrier = slot.ahead, slot.ahead_barrier
            if slot.barrier.wait:
                slot.since_load = 0
            slot.ahead, slot.ahead_barrier = None, None
        slot.draining = False
        self.batches_done += 1
        self.completed_groups.append(groups)
        self.completed_informative.append(informative)
        if not self.plan.asynchronous:
            self.done.setdefault(step, set()).add(slot.name)
            if groups is not None:
                self.groups[step] = self.groups.get(step, 0) + groups
            if informative is None:
                self.uncounted.add(step)  # (a report lost with its explorer): never top it up
            else:
                self.informative[step] = self.informative.get(step, 0) + informative
            # a top-up of an older step never moves the explorer back
            slot.next_step = max(slot.next_step or 0, step + 1)

    def check_trainer_step(self, step: int) -> None:
        """A trainer step may be reported once `TrainerGo` released it (again: a resend)."""
        if step >= self.trainer_go:
            released = f"steps 0..{self.trainer_go - 1}" if self.trainer_go else "no step yet"
            raise StepMismatch(f"the trainer reported step {step}, but the master has "
                               f"released {released}")

    def checkpointed(self, step: int) -> None:
        """The trainer wrote a checkpoint holding steps 0..step-1. Once it keeps
        `keep_checkpoints` of them, the steps before the oldest are forgotten."""
        self.checkpoints = sorted({*self.checkpoints, step})[-self.keep_checkpoints:]
        if len(self.checkpoints) == self.keep_checkpoints:
            self._forget(min(self.checkpoints[0], self.trainer_done))

    def _forget(self, floor: int) -> None:
        if floor <= self.forgotten_through:
            return
        steps = range(self.forgotten_through, floor)
        if self.plan.asynchronous:
            per = self.plan.batches_per_step
            dropped = sum(self.windows[s][1] if s in self.windows else per for s in steps)
            self.forgotten_extra += sum(self.extra.get(s, 0) for s in steps)
        else:
            dropped = len(self.completed_groups)  # read by asynchronous plans only
        del self.completed_groups[:dropped], self.completed_informative[:dropped]
        self.completed_base += dropped
        for per_step in (self.done, self.groups, self.informative, self.extra, self.windows):
            for s in steps:
                per_step.pop(s, None)
        self.uncounted = {s for s in self.uncounted if s >= floor}
        self.reported = {b: r for b, r in self.reported.items() if r[1] >= floor}
        # a resume goes back to `floor` at the earliest: of the versions up to it, the newest
        older = [v for v in self.published_versions if v <= floor]
        self.published_versions = [v for v in self.published_versions
                                   if v > floor or older and v == max(older)]
        self.forgotten_through = floor

    def extend(self, total_steps: int) -> list[Decision]:
        """The run was made longer on resume (`--resume --set master.total_steps=N`, restored
        from a snapshot): a run that stopped for being done goes on."""
        if total_steps == self.total_steps:
            return []
        self.total_steps = total_steps
        if self.stopped and not self.exhausted and self.trainer_done < total_steps:
            self.stopped, self.stop = False, None
        return self._release()

    def trainer_step_done(self, step: int) -> list[Decision]:
        self.trainer_done = max(self.trainer_done, step + 1)
        self.awaiting_trainer = False  # its lineage goes on
        return self._release()

    def await_trainer(self, awaiting: bool) -> list[Decision]:
        """The master restarted (`awaiting`), or the trainer showed its lineage since (a
        heartbeat once its resume is done). While awaiting, barriers wait: the versions in the
        journal may belong to a lineage the trainer is about to set aside."""
        self.awaiting_trainer = awaiting
        return self._release()

    def set_staleness(self, bound: int) -> list[Decision]:
        """`sync.max_staleness: auto` moved the staleness bound (`StalenessSet`): every grant
        from now on holds to `bound`, so a wider one may release explorers at once. Barriers
        granted under the old bound stand; a narrower one holds back the next grants."""
        self.plan = replace(self.plan, max_staleness=bound)
        return self._release()

    def published(self, version: int, method: str | None = None) -> list[Decision]:
        if method == "checkpoint" and self.plan.method == "nccl":
            self.on_disk.add(version)  # a resumed trainer's current version (docs/design.md §5)
        self.newest = max(self.newest, version)
        if version not in self.published_versions:
            self.published_versions.append(version)
        self.awaiting_trainer = False  # published by the lineage that goes on
        return self._release()

    def trainer_resumed(self, step: int) -> list[Decision]:
        """The trainer (re)started from a checkpoint holding steps 0..step-1. The steps after it
        are trained again: the trainer count goes back to `step`, `TrainerGo` is released again
        from there, and versions published after it (by the lineage that was lost) no longer
        count. A run that had stopped for want of those steps goes on.

        With nccl, explorers took the versions up to `newest` by broadcast from the lost
        lineage and cannot take them again: those versions stand, and the retrained steps that
        produce them publish nothing (the first version after them is broadcast as usual)."""
        if step > self.trainer_done:
            raise StepMismatch(f"the trainer resumed at step {step} but the master counted "
                               f"only {self.trainer_done} trainer steps")
        if step < self.forgotten_through:
            raise StepMismatch(f"the trainer resumed at step {step}, before its checkpoint of "
                               f"step {self.forgotten_through} (the oldest of the "
                               f"{self.keep_checkpoints} it keeps, trainer.keep_checkpoints)")
        self.checkpoints = [c for c in self.checkpoints if c <= step]
        if step < self.trainer_done:
            self.trainer_done = step
            if self.plan.method == "nccl":
                self.broadcast_through = max(self.broadcast_through, self.newest)
            else:  # checkpoint: the trainer moved the lost lineage's folders aside
                self.published_versions = [v for v in self.published_versions if v <= step]
                self.newest = max(self.published_versions, default=0)
            self.stopped, self.stop = False, None
        elif self.stopped:
            return []  # nothing was lost: the run is over as it was
        self.trainer_go = self.trainer_done  # the step in flight (if any) is released again
        return self._release()

    # -- state ---------------------------------------------------------------------------------

    @property
    def alive(self) -> list[ExplorerSlot]:
        return [s for s in self.explorers.values() if s.alive]

    @property
    def producing(self) -> list[ExplorerSlot]:
        """Explorers that can still roll out batches."""
        return [s for s in self.explorers.values() if s.alive and not s.finished]

    def _join_step(self) -> int:
        """A joiner is a member from the oldest step the trainer has not been released on, so
        explorers registering together all take part in step 0. With nccl it must also wait
        for a broadcast it can still take part in (docs/design.md §5: a fresh group at the next sync
        point)."""
        plan = self.plan
        if plan.asynchronous:
            return self._async_step(self.batches_granted - self.batches_lost)
        step = self.trainer_go
        if not self.producing:
            # nobody is left to finish the open steps: take over the first one without batches
            # (with nccl its version was broadcast already, so the trainer must send it again)
            while self.done.get(step):
                step += 1
            return step
        if plan.method != "nccl":
            return step
        while True:
            step = plan.join_step(step)
            version = plan.version_for_step(step)
            if version == 0 or version > self.newest:
                return step
            step += 1

    def _expected(self, step: int) -> set[str]:
        members = {s.name for s in self.producing if s.join_step <= step}
        return members | self.done.get(step, set())

    def _trainer_ready(self, step: int) -> bool:
        if self.plan.asynchronous:
            return self._window(step) is not None
        expected = self._expected(step)
        return (bool(expected) and expected <= self.done.get(step, set())
                and not self._wants_top_up(step))

    def _top_up_running(self, step: int) -> bool:
        return any((s.running is not None and s.running[0] == step)
                   or (s.redo is not None and s.redo[0] == step) for s in self.alive)

    def _wants_top_up(self, step: int) -> bool:
        """Dynamic sampling: `step` waits for a top-up batch, in flight or still to grant."""
        if self.top_up_target is None:
            return False
        if self._top_up_running(step):
            return True
        short = (step not in self.uncounted
                 and self.informative.get(step, 0) < self.top_up_target)
        return short and self.extra.get(step, 0) < self.max_extra and bool(self.producing)

    def _window(self, step: int) -> tuple[int, int] | None:
        """Asynchronous plans: the completed batches step `step` trains on, as (first, count),
        or None while it waits. `batches_per_step` of them, and with dynamic sampling more, one
        at a time, until they hold `top_up_target` informative groups, `max_extra` more were
        taken, a batch's count is unknown, or no explorer can produce another."""
        if step in self.windows:
            return self.windows[step]
        per = self.plan.batches_per_step
        first = self._first_batch(step)
        have = len(self.completed_groups) + self.completed_base - first
        if have < per:
            return None
        if self.top_up_target is None:
            return first, per
        head = first - self.completed_base
        counts = self.completed_informative[head:head + min(have, per + self.max_extra)]
        for n in range(per, len(counts) + 1):
            if (None in counts[:n] or sum(counts[:n]) >= self.top_up_target
                    or n == per + self.max_extra):
                return first, n
        return (first, len(counts)) if not self.producing else None

    def _async_step(self, live: int) -> int:
        """Asynchronous plans: the step the next batch granted is for, when `live` batches were
        granted and not lost. Released steps' extra batches came out of later steps' share, so
        they shift every later batch back to the step that will train it: the staleness bound
        is then the one of that step, not of one further ahead, and the plan's total counts
        them as the steps' own."""
        taken = self.forgotten_extra + sum(self.extra.get(s, 0) for s in self.windows)
        return self.plan.step_of_batch(max(0, live - taken))

    def _first_batch(self, step: int) -> int:
        """Asynchronous plans: the index, in completion order, of step `step`'s first batch."""
        per = self.plan.batches_per_step
        return self.completed_base + sum(self.windows[s][1] if s in self.windows else per
                                         for s in range(self.forgotten_through, step))

    def counters(self) -> dict[str, Any]:
        return dict(total_steps=self.total_steps, trainer_steps_done=self.trainer_done,
                    trainer_steps_released=self.trainer_go, newest_version=self.newest,
                    batches_granted=self.batches_granted, batches_done=self.batches_done,
                    batches_lost=self.batches_lost, explorers_alive=len(self.alive),
                    stopped=self.stopped)

    # -- decisions -----------------------------------------------------------------------------

    def _release(self) -> list[Decision]:
        out: list[Decision] = []
        if self.stopped:
            return out
        top_up = None if self.plan.asynchronous else self._grant_top_up()
        if top_up is not None:
            out.append((barrier_topic(top_up.explorer), top_up))
        out += self._grant_all()
        # asynchronous: only an explorer the plan left idle rolls out a top-up
        if self.plan.asynchronous:
            out += [(barrier_topic(b.explorer), b) for b in self._grant_async_top_ups()]
        while (self.trainer_go < self.total_steps and self.trainer_go == self.trainer_done
               and self._trainer_ready(self.trainer_go)):
            t = self.trainer_go
            if self.plan.asynchronous:
                first, batches = self.windows[t] = self._window(t)
                self.extra[t] = batches - self.plan.batches_per_step
                head = first - self.completed_base
                counts = self.completed_groups[head:head + batches]
                groups = None if None in counts else sum(counts)
            else:
                batches = len(self.done.get(t, ())) + self.extra.get(t, 0)
                groups = self.groups.get(t)
            publish = self.plan.publish_after(t, self.total_steps)
            publish_by = None
            if publish is not None and publish <= self.broadcast_through:
                # broadcast by a lost lineage: never again. The newest of them is the version
                # explorers that restarted with the trainer need next: it goes to disk.
                publish, publish_by = ((publish, "checkpoint")
                                       if publish == self.broadcast_through else (None, None))
            self.last_go = TrainerGo(
                step=t, publish=publish, publish_by=publish_by, batches=batches,
                groups=groups, extra_batches=self.extra.get(t, 0),
                explorers=sorted(s.name for s in self.producing),
                in_use=sorted({s.held for s in self.alive if s.held is not None}
                              | {s.running[2] for s in self.alive if s.running is not None}))
            out.append(("trainer", self.last_go))
            self.trainer_go += 1
            if self.extra.get(t, 0) and self.plan.asynchronous:
                # later batches now belong to earlier steps: a grant the staleness bound held
                # back may go now
                out += self._grant_all()
        if self.trainer_done >= self.total_steps:
            self.stop = Stop(reason=f"done: {self.total_steps} trainer steps",
                             steps=self.trainer_done)
        elif (self.exhausted and not self.producing and self.trainer_go == self.trainer_done
              and not any(s.running is not None for s in self.alive)
              and not self._trainer_ready(self.trainer_go)):
            self.stop = Stop(reason=f"taskset exhausted after {self.trainer_done} of "
                                    f"{self.total_steps} trainer steps", steps=self.trainer_done)
        if self.stop is not None:
            self.stopped = True
            out.append(("stop", self.stop))
        self.published_count.update(topic for topic, _ in out)
        return out

    def _grant_all(self) -> list[Decision]:
        """The plan's next batch to every explorer that can take one now."""
        out: list[Decision] = []
        if self.awaiting_trainer:
            return out
        for slot in self.producing:
            if slot.running is None:
                barrier = self._grant(slot)
            elif slot.draining and slot.ahead is None:
                barrier = self._grant_ahead(slot)
            else:
                continue
            if barrier is not None:
                out.append((barrier_topic(slot.name), barrier))
        return out

    def _grant_top_up(self) -> Barrier | None:
        """Dynamic sampling: one more batch for the step the trainer waits for, when all of its
        batches are in with too few informative groups; to the first idle explorer, with the
        weights it holds (the step's own version, at offset 0)."""
        t = self.trainer_go
        if (self.top_up_target is None or self.plan.asynchronous or t >= self.total_steps
                or self.awaiting_trainer
                or t != self.trainer_done or not self._wants_top_up(t)
                or self._top_up_running(t)):
            return None
        expected = self._expected(t)
        if not expected or not expected <= self.done.get(t, set()):
            return None  # the step's own batches first
        for slot in self.producing:
            if slot.running is not None or slot.redo is not None:
                continue
            if slot.held is not None:
                version, load = slot.held, False
            else:
                go = self.plan.decide(t, newest=self.newest, held=None)
                if go is None:
                    continue
                version, load = go.version, go.load
            batch = self.batches_granted
            self.batches_granted += 1
            self.extra[t] = self.extra.get(t, 0) + 1
            slot.running = (t, batch, version)
            slot.held = version
            slot.barrier = Barrier(explorer=slot.name, step=t, version=version, wait=load,
                                   batch=batch, method=self.plan.method)
            return slot.barrier
        return None

    def _grant_async_top_ups(self) -> list[Barrier]:
        """Dynamic sampling, asynchronous plans: more batches for the step the trainer waits
        for, when it is short and no batch is on the way (explorers that are busy produce the
        batches it takes next): as many as it lacks of its own `batches_per_step` (the plan's
        total was spent on earlier steps' extra batches), else one; to idle explorers, with the
        plan's weights for each."""
        t = self.trainer_go
        if (self.top_up_target is None or t >= self.total_steps or t != self.trainer_done
                or self.awaiting_trainer or self._trainer_ready(t)):
            return []
        if any(s.running is not None or s.redo is not None for s in self.alive):
            return []
        have = len(self.completed_groups) + self.completed_base - self._first_batch(t)
        wanted = max(1, self.plan.batches_per_step - have)
        out: list[Barrier] = []
        for slot in self.producing:
            if len(out) == wanted:
                break
            go = self.plan.decide(t, newest=self.newest, held=slot.held,
                                  since_load=slot.since_load)
            if go is None:
                continue
            batch = self.batches_granted
            self.batches_granted += 1
            slot.running = (t, batch, go.version)
            slot.held = go.version
            if go.load:
                slot.since_load = 0
            slot.barrier = Barrier(explorer=slot.name, step=t, version=go.version, wait=go.load,
                                   batch=batch, method=self.plan.method)
            out.append(slot.barrier)
        return out

    def _grant(self, slot: ExplorerSlot) -> Barrier | None:
        plan = self.plan
        if slot.redo is not None:
            step, batch = slot.redo
        elif plan.asynchronous:
            step = self._async_step(self.batches_granted - self.batches_lost)
            if step >= self.total_steps:
                return None
            batch = self.batches_granted
        else:
            step = slot.next_step
            if step is None or step >= self.total_steps:
                return None
            batch = self.batches_granted
        go = plan.decide(step, newest=self.newest, held=slot.held, since_load=slot.since_load)
        if go is None:
            return None
        fresh = slot.held is None
        if slot.redo is None:
            self.batches_granted += 1
        slot.redo = None
        slot.running = (step, batch, go.version)
        slot.held = go.version
        if go.load:
            slot.since_load = 0
        # a fresh explorer under nccl takes a version a resumed trainer wrote from disk: it
        # went by in a broadcast and is never sent again
        method = ("checkpoint" if plan.method == "nccl" and go.load and fresh
                  and go.version in self.on_disk else plan.method)
        # placement.colocate: after this rollout the trainer takes the devices (after the last
        # step too, unless the explorer evaluates at the end: the last version is not
        # published, so nothing could wake it for that)
        sleep = slot.name == self.colocated and (step + 1 < self.total_steps
                                                 or self.colocated_sleeps_last)
        slot.barrier = Barrier(explorer=slot.name, step=step, version=go.version, wait=go.load,
                               batch=batch, method=method, sleep_after=sleep)
        return slot.barrier

    def _grant_ahead(self, slot: ExplorerSlot) -> Barrier | None:
        """Asynchronous plans: the next batch for an explorer whose running batch drains. The
        same rule as any grant (the total, the staleness bound, a load every `interval`
        batches), counting the running batch as rolled out with the weights it holds."""
        plan = self.plan
        step = self._async_step(self.batches_granted - self.batches_lost)
        batch = self.batches_granted
        if step >= self.total_steps:
            return None
        if step == slot.running[0]:
            return None  # an explorer's lease is per step: one batch of a step at a time
        go = plan.decide(step, newest=self.newest, held=slot.held,
                         since_load=slot.since_load + 1)
        if go is None:
            return None
        self.batches_granted += 1
        slot.ahead = (step, batch, go.version)
        slot.held = go.version
        slot.ahead_barrier = Barrier(explorer=slot.name, step=step, version=go.version,
                                     wait=go.load, batch=batch, method=plan.method)
        return slot.ahead_barrier
