"""Fixtures for the reward tests: short sandbox limits, and a way to spot stray processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from backstop import BACKSTOP

from tandem.common.config.reward import CodeSandboxConfig, RewardConfig


@pytest.fixture
def reward_config() -> RewardConfig:
    """Small memory, process, file and output limits, so adversarial programs end quickly; time
    limits no honest program comes near (a run's wall clock includes its sandbox and interpreter
    starting, seconds on a loaded machine). A test of a time limit sets that one short."""
    return RewardConfig(
        functions={"code": 1.0}, workers=2, timeout=BACKSTOP, request_timeout=BACKSTOP,
        code=CodeSandboxConfig(cpu_seconds=BACKSTOP, wall_seconds=BACKSTOP, memory_mb=256,
                               nproc=16, file_size_mb=1, max_output_bytes=64 * 1024))


@pytest.fixture
def processes_mentioning():
    """`processes_mentioning(text)`: live pids whose command line contains `text`."""
    return _processes_mentioning


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (the sandbox folder names every run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found
