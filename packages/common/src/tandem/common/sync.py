"""The sync plan (docs/design.md §4): which weights each explorer step uses and who waits for whom.

This module is the only place the synchronisation rules live. The master applies them to live
counters, `tandem plan` replays them over assumed durations, explorers and trainers may read them
to know what to expect; none of it touches a socket.

Counting. A *step* `e` is the unit of rollout that trainer step `e` trains on:

- One explorer: step `e` is its `e`-th batch (docs/design.md §4 word for word).
- Several explorers, synchronous plans (`offset` set): step `e` is a round, one batch from every
  explorer taking part; trainer step `t` trains on all batches of round `t`. Each explorer counts
  its own steps and may run ahead of the others as far as the plan lets it.
- Several explorers, asynchronous plans (`offset: null`): batches are numbered globally in the
  order the master hands them out (`g = 0, 1, 2, ...`), batch `g` belongs to step
  `g // batches_per_step`, and a trainer step trains on `batches_per_step` complete batches. With
  `batches_per_step` equal to the number of explorers this matches the one-explorer reading when
  explorers run at the same pace, and keeps the staleness bound meaningful when they do not.

Versions. Version `v` is the weights after `v` trainer steps; version 0 is the base model every
explorer starts from without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Method = Literal["nccl", "checkpoint"]

# The one list of preset names: the config's `sync.preset`, `tandem plan --preset` and
# `tandem quickstart --preset` all take their choices from it.
PRESETS: dict[str, dict[str, Any]] = {
    "synchronous": dict(method="nccl", interval=1, offset=0, max_staleness=0),
    "one_step_off_policy": dict(method="nccl", interval=1, offset=1, max_staleness=1),
    "fully_async": dict(method="checkpoint", interval=1, offset=None, max_staleness=4),
    "multi_explorer_async": dict(method="checkpoint", interval=1, offset=None, max_staleness=4),
}

# The explorers a run of a preset has where nothing else says (`tandem plan`, `tandem quickstart`,
# the preset tests and benchmarks); a preset not named here runs one. multi_explorer_async with
# fewer explorers is fully_async.
PRESET_EXPLORERS: dict[str, int] = {"multi_explorer_async": 2}


def preset_explorers(preset: str | None) -> int:
    """How many explorers a run of `preset` has where nothing else says (`PRESET_EXPLORERS`)."""
    return PRESET_EXPLORERS.get(preset or "", 1)


def check_knobs(method: str, interval: int, offset: int | None, max_staleness: int) -> None:
    """The rules every set of `sync` knobs obeys (the config, `tandem plan` and `SyncPlan` all
    check through here); raises ValueError naming the key and how to fix it."""
    if method not in ("nccl", "checkpoint"):
        raise ValueError(f"sync.method must be nccl or checkpoint, got {method!r}")
    if interval < 1:
        raise ValueError(f"sync.interval must be >= 1, got {interval}")
    if offset is not None and offset < 0:
        raise ValueError(f"sync.offset must be >= 0, or null for an asynchronous plan, got "
                         f"{offset}")
    if max_staleness < 0:
        raise ValueError(f"sync.max_staleness must be >= 0, got {max_staleness}")
    if offset is None and method == "nccl":
        raise ValueError("sync.offset: null (asynchronous) cannot use sync.method: nccl, because "
                         "a broadcast needs both sides at a sync point; set sync.method: "
                         "checkpoint or give sync.offset")


@dataclass(frozen=True)
class Go:
    """An explorer may start `step` rolling out with weights `version`; `load` them first if set."""

    step: int
    version: int
    load: bool


@dataclass(frozen=True)
class SyncPlan:
    """The rules of docs/design.md §4 as a pure function of the knobs and the counters."""

    method: Method = "nccl"
    interval: int = 1
    offset: int | None = 0
    max_staleness: int = 0
    batches_per_step: int = 1

    def __post_init__(self) -> None:
        check_knobs(self.method, self.interval, self.offset, self.max_staleness)
        if self.batches_per_step < 1:
            raise ValueError(f"batches_per_step must be >= 1, got {self.batches_per_step}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> SyncPlan:
        """One of the four presets of docs/design.md §4, with knobs given explicitly winning."""
        if name not in PRESETS:
            raise ValueError(f"unknown sync preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_config(cls, sync: Any, batches_per_step: int = 1) -> SyncPlan:
        """From a `SyncConfig`; `max_staleness: auto` starts
        at its first bound (the master moves it: `tandem.common.staleness`)."""
        return cls(method=sync.method, interval=sync.interval, offset=sync.offset,
                   max_staleness=sync.initial_staleness, batches_per_step=batches_per_step)

    @property
    def asynchronous(self) -> bool:
        return self.offset is None

    # -- explorer side -------------------------------------------------------------------------

    def is_sync_point(self, step: int) -> bool:
        """Steps `e > offset` with `(e - offset) % interval == 0` (offset 0 when asynchronous)."""
        offset = self.offset or 0
        return step > offset and (step - offset) % self.interval == 0

    def version_for_step(self, step: int) -> int:
        """Synchronous plans: the version step `e` rolls out with (the latest sync point's)."""
        self._need_synchronous("version_for_step")
        if step <= self.offset:
            return 0
        last_sync = step - (step - self.offset) % self.interval
        return last_sync - self.offset

    def min_version(self, step: int) -> int:
        """The version that must be published before step `e` may start (0: no wait).

        Synchronous: `e - offset` at a sync point, else 0. Asynchronous: the staleness bound
        `e - max_staleness`.
        """
        if self.asynchronous:
            return max(0, step - self.max_staleness)
        return step - self.offset if self.is_sync_point(step) else 0

    def required_trainer_step(self, step: int) -> int | None:
        """The trainer step that must be done before step `e` may start, or None."""
        need = self.min_version(step)
        return need - 1 if need > 0 else None

    def decide(self, step: int, *, newest: int, held: int | None,
               since_load: int = 0) -> Go | None:
        """May an explorer start `step` now? None means wait for the trainer.

        `newest` is the newest published version, `held` the version the explorer has loaded
        (None: it has not started yet or restarted), `since_load` the batches it rolled out since
        it last loaded weights (asynchronous plans: it loads every `interval` batches).
        """
        if not self.asynchronous:
            version = self.version_for_step(step)
            if held is not None and (not self.is_sync_point(step) or held >= version):
                # between sync points, or ahead of the step's version: an explorer that rejoined
                # a broadcast took the newest version, and an older one is never sent again
                return Go(step, held, load=False)
            if newest < version:  # a sync point, or a joiner that needs the current version
                return None
            if held is None and self.method == "nccl" and newest > version:
                # a fresh incarnation (restarted, or redoing a dead one's step) can receive only
                # a broadcast still to come: the trainer's retry of `newest` to a fresh group that
                # names it. `version` went by in a broadcast it was not in and is never sent again.
                return Go(step, newest, load=True)
            return Go(step, version, load=version > 0)
        floor = self.min_version(step)
        if newest < floor:
            return None
        if held is None:
            return Go(step, newest, load=newest > 0)
        must = held < floor
        due = since_load >= self.interval and newest > held
        if must or due:
            return Go(step, newest, load=True)
        return Go(step, held, load=False)

    def join_step(self, first_unstarted: int) -> int:
        """The first step of an explorer joining when no one has started `first_unstarted` yet.

        With nccl a late joiner can only receive weights in a broadcast, so it joins at the next
        sync point (docs/design.md §5); with checkpoint it loads the current version from disk and joins
        at once. Asynchronous plans number batches globally, so the joiner takes the next one.
        """
        if first_unstarted <= 0 or self.asynchronous or self.method == "checkpoint":
            return max(0, first_unstarted)
        step = first_unstarted
        while self.version_for_step(step) > 0 and not self.is_sync_point(step):
            step += 1
        return step

    def step_of_batch(self, batch: int) -> int:
        """Asynchronous plans: the step a globally numbered batch belongs to."""
        return batch // self.batches_per_step

    # -- trainer side --------------------------------------------------------------------------

    def publish_after(self, trainer_step: int, total_steps: int | None = None) -> int | None:
        """The version the trainer publishes after step `t`, or None when no explorer needs it.

        Synchronous: `t + 1` when it is some sync point's version. Asynchronous: every version,
        since explorers load the newest. A version no step before `total_steps` would use is not
        published (the trainer's final checkpoint is its own business).
        """
        version = trainer_step + 1
        if self.asynchronous:
            needed_by = version
        else:
            if version % self.interval != 0:
                return None
            needed_by = version + self.offset
        if total_steps is not None and needed_by >= total_steps:
            return None
        return version

    def broadcast_step(self, version: int) -> int | None:
        """nccl: the explorer step at whose sync point `version` is broadcast; the trainer holds
        the broadcast open until every explorer taking part reaches it. None for checkpoint."""
        if self.method != "nccl" or self.asynchronous:
            return None
        return version + self.offset

    def describe(self) -> dict[str, Any]:
        return dict(method=self.method, interval=self.interval, offset=self.offset,
                    max_staleness=self.max_staleness, batches_per_step=self.batches_per_step)

    def _need_synchronous(self, what: str) -> None:
        if self.asynchronous:
            raise ValueError(f"{what} is defined for synchronous plans only (offset is null)")
