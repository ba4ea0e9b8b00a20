"""The `placement` section (docs/design.md §8): which CPU threads and devices each component gets.

Components that overlap in time must not fight over the same cores: with every process taking
every core, overlapping rollout and training only adds contention and the asynchronous presets
run slower than the synchronous one. `resolve_placement` turns this section into one
`Assignment` per process; `tandem up` puts it in each child's environment and every component CLI
applies its own (`apply_placement`) before torch is imported, so a CLI started by a process
supervisor honours it too.

`auto` shares out this machine's cores: when the sync plan lets the trainer and the explorers
overlap (any preset but interval 1 / offset 0), the trainer gets half of them (rounded up) and the
explorers share the rest; when they strictly alternate, each side gets every core. The control
plane (master, buffer, reward service) gets one thread: it moves messages, not tensors.

`colocate: [trainer, explorer-0]` time-shares the trainer's devices with one explorer (docs/
deployment.md, "one node, shared GPUs"): the explorer gets the trainer's `devices`, and the run
goes as the synchronous figure draws it, rollout, then train, then sync. Between its rollout and
the next version the explorer's engine sleeps (its weights and KV cache released) and it wakes to
the new version from shared memory. `check_colocation` says where that cannot work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from .base import Section

if TYPE_CHECKING:
    from . import RunConfig

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# placement.colocate: glibc serves a large block from its own mapping, returned to the system on
# free, instead of from a heap that keeps its high-water mark; read when a process starts, so
# `tandem up` puts it in the environment of the trainer and the colocated explorer
COLOCATED_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


class ComponentPlacement(Section):
    """One component's share of the machine."""

    threads: int | None = Field(
        default=None, ge=1, description="CPU threads (torch intra-op, OMP, MKL); null = the "
                                        "`policy`'s share")
    devices: str | None = Field(
        default=None, description="CUDA_VISIBLE_DEVICES for it, e.g. '0' or '0,1'; null = leave "
                                  "the environment's")


class TrainerPlacement(ComponentPlacement):
    """The trainer's share; `nproc` > 1 makes `tandem up` launch it under torchrun."""

    nproc: int = Field(default=1, ge=1, description="trainer processes (torchrun "
                                                    "--nproc-per-node) that `tandem up` starts; "
                                                    "threads are split between them")


class PlacementConfig(Section):
    """Cores and devices per component."""

    policy: Literal["auto", "inherit"] = Field(
        default="auto", description="auto: share this machine's cores out (see docs/sync.md); "
                                    "inherit: whatever the environment gives, except what is "
                                    "set below")
    cores: int | None = Field(default=None, ge=1,
                              description="cores to share out under auto (default: the cores "
                                          "this process may run on)")
    trainer: TrainerPlacement = Field(default_factory=TrainerPlacement)
    explorers: ComponentPlacement = Field(default_factory=ComponentPlacement,
                                          description="each explorer process")
    control: ComponentPlacement = Field(
        default_factory=lambda: ComponentPlacement(threads=1),
        description="master, buffer and reward service")
    colocate: list[str] = Field(
        default_factory=list,
        description="[trainer, EXPLORER]: the explorer shares the trainer's devices; its engine "
                    "sleeps (weights and KV cache released) while the trainer trains and wakes "
                    "to each new version from shared memory. Needs a strictly alternating plan "
                    "(sync.offset 0, sync.interval 1), sync.method checkpoint, "
                    "weights.transport shared_memory, one rollout explorer and an engine that "
                    "declares sleep; [] = no colocation")


@dataclass(frozen=True)
class Assignment:
    """What one process gets: threads (None = untouched), devices (None = untouched)."""

    role: str
    threads: int | None
    devices: str | None = None
    nproc: int = 1
    colocated: bool = False

    def env(self) -> dict[str, str]:
        """The environment variables a child process is started with."""
        out = {key: str(self.threads) for key in THREAD_ENV} if self.threads else {}
        if self.devices is not None:
            out["CUDA_VISIBLE_DEVICES"] = self.devices
        if self.colocated:
            out.update(COLOCATED_ENV)
        return out

    def describe(self) -> str:
        parts = [f"{self.threads} thread{'s' if self.threads > 1 else ''}" if self.threads
                 else "threads as inherited"]
        if self.nproc > 1:
            parts.append(f"torchrun x{self.nproc}")
        if self.devices is not None:
            parts.append(f"devices {self.devices or 'none'}")
        return ", ".join(parts)


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def overlaps(config: RunConfig) -> bool:
    """Whether trainer and explorers run at the same time under this sync plan."""
    s = config.sync
    return not (s.offset == 0 and s.interval == 1)


def colocated_explorer(config: RunConfig) -> str | None:
    """The explorer that time-shares the trainer's devices (`placement.colocate`), if any."""
    names = [n for n in config.placement.colocate if n != "trainer"]
    return names[0] if names else None


def evaluates_at_end(config: RunConfig, name: str | None) -> bool:
    """Whether explorer `name` evaluates the weights it holds when the run ends (a colocated
    one then stays awake after its last step: the last version is never published)."""
    e = config.eval
    return name is not None and e.enabled and e.at_end and config.evaluating_explorer == name


def check_colocation(config: RunConfig) -> list[str]:
    """Why `placement.colocate` cannot work with this config; one problem per line, each
    naming the key to change. An engine asleep while the trainer works needs the trainer and
    the explorer never to overlap, and a way to wake to new weights without a file."""
    names = config.placement.colocate
    if not names:
        return []
    explorers = [e.name for e in config.explorers]
    others = [n for n in names if n != "trainer"]
    if "trainer" not in names or len(others) != 1 or len(set(names)) != len(names):
        return [f"placement.colocate: {names} must name the trainer and one explorer, e.g. "
                f"[trainer, {explorers[0]}]"]
    problems: list[str] = []
    name = others[0]
    if name not in explorers:
        return [f"placement.colocate: no explorer named {name!r} (explorers: {explorers})"]
    if config.explorer(name).role == "eval":
        problems.append(f"placement.colocate: {name} has role eval, which loads versions while "
                        "the trainer trains; colocate a rollout explorer")
    rollout = [e.name for e in config.rollout_explorers]
    if len(rollout) > 1:
        problems.append(f"placement.colocate: one explorer shares the trainer's devices and the "
                        f"others ({[n for n in rollout if n != name]}) would roll out while it "
                        "trains; colocated runs take one rollout explorer")
    s = config.sync
    if s.offset != 0 or s.interval != 1:
        problems.append(f"placement.colocate: the explorer sleeps while the trainer trains, "
                        f"which needs rollout and training to alternate (sync.offset: 0, "
                        f"sync.interval: 1, e.g. sync.preset: synchronous), not offset "
                        f"{'null (asynchronous)' if s.offset is None else s.offset} and "
                        f"interval {s.interval}")
    if s.method != "checkpoint" or config.weights.transport != "shared_memory":
        problems.append(f"placement.colocate: the engine wakes to each version from shared "
                        f"memory; set sync.method: checkpoint and weights.transport: "
                        f"shared_memory (now {s.method}, {config.weights.transport})")
    p = config.placement
    if p.explorers.devices is not None and p.explorers.devices != p.trainer.devices:
        problems.append(f"placement.explorers.devices: {p.explorers.devices!r}, but a colocated "
                        f"explorer takes the trainer's ({p.trainer.devices!r}); leave it unset")
    return problems


def resolve_placement(config: RunConfig, cores: int | None = None) -> dict[str, Assignment]:
    """One Assignment per process name: master, buffer, reward, trainer, each explorer."""
    p = config.placement
    total = cores or p.cores or machine_cores()
    auto = p.policy == "auto"
    names = [e.name for e in config.explorers]
    if overlaps(config):
        trainer_cores = max(1, -(-total // 2)) if total > 1 else 1
        explorer_cores = max(1, (total - trainer_cores) // len(names)) if total > 1 else 1
    else:
        trainer_cores, explorer_cores = total, max(1, total // len(names))
    out: dict[str, Assignment] = {}
    control = p.control.threads if p.control.threads else (1 if auto else None)
    for name in ("master", "buffer", "reward"):
        out[name] = Assignment("control", control, p.control.devices)
    t = p.trainer
    threads = t.threads if t.threads else (max(1, trainer_cores // t.nproc) if auto else None)
    shared = colocated_explorer(config)
    out["trainer"] = Assignment("trainer", threads, t.devices, t.nproc,
                                colocated=shared is not None)
    e = p.explorers
    for name in names:
        out[name] = Assignment("explorer", e.threads if e.threads else (
            explorer_cores if auto else None), t.devices if name == shared else e.devices,
            colocated=name == shared)
    return out


def assignment_for(config: RunConfig, name: str) -> Assignment:
    """The Assignment of the process called `name` (trainer ranks share the trainer's)."""
    table = resolve_placement(config)
    if name.startswith("trainer"):
        return table["trainer"]
    return table.get(name, table["master"])


def apply_placement(config: RunConfig, name: str) -> Assignment:
    """Apply `name`'s share to this process: the environment now (OMP_NUM_THREADS and friends,
    read by torch, OpenMP and MKL when they load), and torch's intra-op threads when torch is
    already loaded. The control plane never imports torch itself (the import contracts in
    pyproject.toml say so): a trainer or explorer that loads it later reads the environment."""
    import sys

    assignment = assignment_for(config, name)
    os.environ.update(assignment.env())
    torch = sys.modules.get("torch")
    if assignment.threads and torch is not None:
        torch.set_num_threads(assignment.threads)
    return assignment
