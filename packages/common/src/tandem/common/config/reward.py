"""The `reward` section: which reward functions score a task, their limits, and the service."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Section


class CodeSandboxConfig(Section):
    """Limits of the sandbox that runs candidate programs (`reward.code`), per test case; an
    evaluation's budget is its number of tests × (wall_seconds + 1 s)."""

    cpu_seconds: float = Field(default=5.0, gt=0, description="CPU time (RLIMIT_CPU) per test")
    wall_seconds: float = Field(
        default=10.0, gt=0, description="wall-clock time per test before the whole process "
                                        "tree is killed")
    memory_mb: int = Field(default=512, ge=64, description="memory per run (a cgroup, when "
                                                           "writable) and address space per "
                                                           "process (RLIMIT_AS), MiB")
    nproc: int = Field(default=16, ge=1, description="processes and threads (RLIMIT_NPROC)")
    file_size_mb: float = Field(
        default=16.0, gt=0, description="largest file written (RLIMIT_FSIZE), MiB")
    open_files: int = Field(default=64, ge=16, description="file descriptors (RLIMIT_NOFILE)")
    max_output_bytes: int = Field(
        default=1 << 20, ge=1024, description="stdout or stderr bytes read before the run is "
                                              "killed as output_limit")
    python: str | None = Field(
        default=None, description="interpreter that runs candidates; default: this one")
    isolation: Literal["auto", "namespaces", "none"] = Field(
        default="auto",
        description="auto or namespaces: each run in a bubblewrap sandbox (minimal read-only "
                    "root, fresh PID/network/IPC namespaces, tmpfs /tmp); refuses to start "
                    "without bwrap. none: rlimits and a process group only, for trusted code")
    uid_base: int = Field(
        default=61000, ge=1000,
        description="when running as root, each sandbox slot runs as a uid/gid of its own, "
                    "the first free from uid_base up (claimed host-wide, so no two sandboxes "
                    "share one), so the process limit counts only that slot's processes")


class RewardModelConfig(Section):
    """A Hugging Face sequence-classification model scoring (prompt, response) pairs."""

    path: str | None = Field(default=None, description="model folder on disk")
    batch_size: int = Field(default=16, ge=1, description="pairs per forward pass")
    linger: float = Field(
        default=0.005, ge=0, description="seconds to wait for more pairs to fill a batch")
    max_length: int = Field(default=1024, ge=8, description="tokens per pair; longer ones are "
                                                            "truncated from the left")
    device: str = Field(default="cpu", description="cpu, cuda, cuda:1 ...")
    label: int = Field(default=0, ge=0, description="which output logit is the reward")
    normalize: Literal["none", "sigmoid"] = Field(
        default="none", description="sigmoid maps the logit into (0, 1)")


class RewardConfig(Section):
    """Reward functions by registry name with weights; in-process unless `service` is set."""

    functions: dict[str, float] = Field(
        default_factory=lambda: {"math": 1.0},
        description="registry name -> weight; the score is the weighted sum, each function's "
                    "own score is a named component")
    args: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="registry name -> default arguments, under each item's own `args`")
    service: bool = Field(default=False, description="score through the tandem-reward service")
    address: str = Field(default="tcp://127.0.0.1:5570", description="service RPC address")
    workers: int = Field(
        default=2, ge=1,
        description="worker processes for pure functions (math) and concurrent code sandboxes")
    timeout: float = Field(
        default=10.0, gt=0, description="seconds per evaluation before it scores 0 with reason "
                                        "'timeout'")
    request_timeout: float = Field(
        default=120.0, gt=0, description="seconds a client waits for the service to score one "
                                         "batch")
    max_batch: int = Field(default=4096, ge=1, description="items in one service request")
    code: CodeSandboxConfig = Field(default_factory=CodeSandboxConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)

    @model_validator(mode="after")
    def _consistent(self) -> RewardConfig:
        if not self.functions:
            raise ValueError(
                "reward.functions: name at least one reward function, e.g. {math: 1.0}")
        for name, weight in self.functions.items():
            if not math.isfinite(weight):
                raise ValueError(f"reward.functions.{name}: weight must be a finite number")
        if "reward_model" in self.functions and not self.reward_model.path:
            raise ValueError("reward.functions uses reward_model: set reward.reward_model.path "
                             "to the model folder")
        if self.request_timeout < self.timeout:
            raise ValueError(
                f"reward.request_timeout ({self.request_timeout:g}s) is shorter than "
                f"reward.timeout ({self.timeout:g}s): a client would give up before one "
                "evaluation may end; raise request_timeout or lower timeout")
        return self
