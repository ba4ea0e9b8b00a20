"""A run dir means one run: the run its journal records, and whether a config may join it.

The master's journal (`run_dir/master/journal.bin`, docs/design.md §7) starts with `RunStarted`,
which holds the run's config as `recorded_config` writes it (the resolved config, secrets as
`${env:...}` references). A resume that changed a key that may change on resume appends
`RunAmended` with the config the run goes on under. Every CLI that joins a run (each component
and `tandem up`) calls `join_run` before it starts anything:

- no journal yet: a new run;
- the same config (keys in `OPERATIONAL` never count), or `--resume` with only `RESUMABLE` keys
  changed by their rule: the run goes on;
- any other difference: `RunDirTaken`, one line naming the run dir, each key with both values
  and the two ways out;
- a finished run (every step counted, and the newest trainer checkpoint holds them all, design
  P3): `JoinedRun.finished`, and the caller exits 0 without starting anything. A run whose
  count is complete but whose checkpoint is short (everything was killed before the last one
  was written) goes on: its trainer retrains the steps after its checkpoint.

Reading is lenient (the frames stop at the first one that does not read back whole): the
master's replay, not this check, decides what is damage.
"""

from __future__ import annotations

import fnmatch
import json
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from .errors import TandemError

if TYPE_CHECKING:
    from .config import RunConfig

FRAME_HEAD = struct.Struct(">II")  # a journal frame: payload length, crc32 of the payload

# Keys that do not change what the run computes (where it listens, how it logs, how it is
# supervised or placed, timeouts, transfer mechanics, evaluation): never a difference.
OPERATIONAL = (
    "name", "run_dir", "transport.*", "logging.*", "up.*", "placement.*", "eval.*",
    "sync.timeout",
    "master.address", "master.publish_address", "master.task_lease_seconds", "master.stop_grace",
    "master.final_checkpoint_wait",
    "buffer.address", "buffer.retry_after", "buffer.lease_seconds", "buffer.synchronous",
    "buffer.commit_batch", "buffer.max_sample_wait", "buffer.max_parked_per_client",
    "reward.service", "reward.address", "reward.workers", "reward.timeout",
    "reward.request_timeout", "reward.max_batch", "reward.reward_model.batch_size",
    "reward.reward_model.linger", "reward.reward_model.device",
    "explorers.*.engine.device", "explorers.*.engine.max_batch",
    "explorers.*.engine.tensor_parallel_size", "explorers.*.engine.api_key",
    "explorers.*.engine.request_timeout", "explorers.*.engine.max_concurrency",
    "explorers.*.openai.address", "explorers.*.openai.max_concurrency",
    "explorers.*.openai.batch_window", "explorers.*.put_timeout", "explorers.*.drain_seconds",
    "trainer.device", "trainer.gradient_checkpointing", "trainer.parallel",
    "trainer.micro_batch_tokens", "trainer.sample_wait", "trainer.idle_timeout",
    "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.tensorboard",
    "weights.*",
)


def _upward(recorded: Any, given: Any) -> str | None:
    if isinstance(recorded, int) and isinstance(given, int) and given > recorded:
        return None
    return "may only go up on resume"


# Keys that may change on `--resume`, each with its rule: a reason it may not, or None.
RESUMABLE: dict[str, Callable[[Any, Any], str | None]] = {"master.total_steps": _upward}


class RunDirTaken(TandemError):
    """The run dir holds a run that this config may not join; one line with the ways out."""


@dataclass(frozen=True)
class Difference:
    """One key whose value the run recorded and the given config disagree on."""

    key: str
    recorded: Any
    given: Any

    def refusal(self) -> str | None:
        """Why this key may not change on resume; None when it may."""
        rule = RESUMABLE.get(self.key)
        return "cannot change on resume" if rule is None else rule(self.recorded, self.given)

    def __str__(self) -> str:
        return f"{self.key} {_show(self.recorded)} (run) -> {_show(self.given)} (given)"


_ABSENT = object()


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else "null" if value is None else repr(value)


def recorded_config(config: RunConfig) -> dict[str, Any]:
    """The config as the journal records it: resolved, with every secret as a reference."""
    from .config.transport import move_secrets_to_env

    data = config.model_dump(mode="json")
    move_secrets_to_env(data)
    return data


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value}; list items by index (`explorers.0.name`)."""
    items = (data.items() if isinstance(data, dict)
             else enumerate(data) if isinstance(data, list) else None)
    if items is None or (not data and prefix):
        return {prefix[:-1]: data}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def operational(key: str) -> bool:
    """Whether `key` (dotted, list items by index) never counts as a difference."""
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in OPERATIONAL)


def differences(recorded: dict[str, Any], given: dict[str, Any]) -> list[Difference]:
    """The keys that change the run, in the given config's order, then those it lacks."""
    old, new = flatten(recorded), flatten(given)
    keys = list(new) + [k for k in old if k not in new]
    return [Difference(k, old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in keys
            if not operational(k) and old.get(k, _ABSENT) != new.get(k, _ABSENT)]


@dataclass
class RunRecord:
    """What a journal says about its run: id, length, config and the trainer's count."""

    run_id: str
    total_steps: int
    config: dict[str, Any] | None  # None: written before journals recorded their config
    trainer_steps: int = 0


def read_run_record(path: str | Path) -> RunRecord | None:
    """The run a journal records, or None when it holds no whole first record."""
    from .codec import decode
    from .errors import ProtocolError
    from .messages.master import (
        JournalSnapshot,
        RunAmended,
        RunStarted,
        TrainerResumed,
        TrainerStepDone,
    )

    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    record: RunRecord | None = None
    pos = 0
    while pos + FRAME_HEAD.size <= len(data):
        length, crc = FRAME_HEAD.unpack_from(data, pos)
        payload = data[pos + FRAME_HEAD.size:pos + FRAME_HEAD.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        pos += FRAME_HEAD.size + length
        try:
            msg = decode([payload], max_message_bytes=max(length, 1)).body
        except ProtocolError:
            break
        if record is None:
            if isinstance(msg, JournalSnapshot):  # a compacted journal: the run so far
                record = RunRecord(msg.run_id, msg.total_steps, msg.config, msg.trainer_steps)
                continue
            if not isinstance(msg, RunStarted):
                break
            record = RunRecord(msg.run_id, msg.total_steps, msg.config)
        elif isinstance(msg, RunAmended):
            record.total_steps, record.config = msg.total_steps, msg.config
        elif isinstance(msg, TrainerStepDone):
            record.trainer_steps = max(record.trainer_steps, msg.step + 1)
        elif isinstance(msg, TrainerResumed):
            record.trainer_steps = min(record.trainer_steps, msg.step)
    return record


def journal_path(config: RunConfig) -> Path:
    return Path(config.run_dir) / config.master.journal


def newest_checkpoint(root: Path) -> tuple[int, Path | None]:
    """The steps the newest complete trainer checkpoint under `root` holds, and its folder
    ((0, None): none), from its `trainer_state.json` (the layout of `tandem.trainer.checkpoint`,
    read here without importing torch)."""
    best: tuple[int, Path | None] = (0, None)
    for folder in root.glob("step_*"):
        try:
            step = int(json.loads((folder / "trainer_state.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not complete (a checkpoint is renamed into place once written)
        best = max(best, (step, folder), key=lambda b: b[0])
    return best


@dataclass(frozen=True)
class JoinedRun:
    """The run a CLI joins: `record` as the journal has it, the length it goes on to, and the
    steps its newest trainer checkpoint holds (None: the disk was not looked at)."""

    record: RunRecord
    total_steps: int
    changed: tuple[Difference, ...]
    checkpointed: int | None = None

    @property
    def short(self) -> bool:
        """The newest checkpoint holds fewer steps than the journal counted."""
        return self.checkpointed is not None and self.checkpointed < self.record.trainer_steps

    @property
    def finished(self) -> bool:
        return self.record.trainer_steps >= self.total_steps and not self.short

    def line(self, run_dir: str) -> str:
        r = self.record
        if self.finished:
            return (f"run {r.run_id} in {run_dir} is finished ({r.trainer_steps} of "
                    f"{self.total_steps} trainer steps); nothing to do. To train it longer: "
                    f"--resume --set master.total_steps=N (N > {self.total_steps}); for a new "
                    "run: a new run_dir")
        notes = [str(d) for d in self.changed]
        if self.short:
            notes.append(f"the newest checkpoint holds {self.checkpointed}: steps "
                         f"{self.checkpointed}..{r.trainer_steps - 1} are retrained")
        return (f"continuing run {r.run_id} in {run_dir} at step {r.trainer_steps} of "
                f"{self.total_steps}" + (f" ({'; '.join(notes)})" if notes else ""))


def check_against(record: RunRecord, config: RunConfig, *, resume: bool) -> JoinedRun:
    """Whether `config` may join the run `record` describes; raises `RunDirTaken` if not."""
    given = recorded_config(config)
    # master.total_steps unset: the taskset decides the length, which the journal holds (and
    # a taskset that changed is a difference of its own keys)
    given["master"]["total_steps"] = given["master"]["total_steps"] or record.total_steps
    if record.config is None:  # an older journal: only its length is known
        recorded = {"master": {"total_steps": record.total_steps}}
        given = {"master": {"total_steps": given["master"]["total_steps"]}}
    else:
        recorded = {**record.config, "master": {**record.config["master"],
                                                 "total_steps": record.total_steps}}
    diffs = differences(recorded, given)
    refused = [d for d in diffs if d.refusal()] if resume else diffs
    if refused:
        raise RunDirTaken(_refusal(record, config.run_dir, refused, resume=resume))
    return JoinedRun(record, given["master"]["total_steps"], tuple(diffs))


def _refusal(record: RunRecord, run_dir: str, refused: list[Difference], *,
             resume: bool) -> str:
    may = ", ".join(f"{k} (upward)" if RESUMABLE[k] is _upward else k for k in RESUMABLE)
    head = (f"run_dir {run_dir} holds run {record.run_id} (step {record.trainer_steps} of "
            f"{record.total_steps})")
    if resume:
        keys = "; ".join(f"{d} {d.refusal()}" for d in refused)
        return (f"{head}, and --resume continues it under its own config: {keys}. Give a new "
                f"run a new run_dir, or resume with only {may} changed by --set")
    keys = "; ".join(str(d) for d in refused)
    return (f"{head} under another config: {keys}. Give a new run a new run_dir, or continue "
            f"this one with --resume, changing only {may} by --set")


def join_run(config: RunConfig, *, resume: bool) -> JoinedRun | None:
    """The run in `config.run_dir` that `config` joins (None: none yet); `RunDirTaken` when the
    run dir holds a run this config may not join."""
    record = read_run_record(journal_path(config))
    if record is None:
        return None
    joined = check_against(record, config, resume=resume)
    step, _ = newest_checkpoint(Path(config.run_dir) / "checkpoints")
    return replace(joined, checkpointed=step)


__all__ = ["FRAME_HEAD", "OPERATIONAL", "RESUMABLE", "Difference", "JoinedRun", "RunDirTaken",
           "RunRecord", "check_against", "differences", "flatten", "join_run", "newest_checkpoint",
           "operational", "read_run_record", "recorded_config"]
