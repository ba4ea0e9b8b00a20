"""Failpoints: named places in a component where a fault test stops the process at an exact
moment of its own work, instead of racing it with a poll loop (docs/reliability.md).

Off unless `TANDEM_FAILPOINTS` names a folder (`tools/chaos.py` sets it for the `tandem up` it
starts). A file in that folder named after a failpoint arms it once: the first process to reach
the failpoint removes the file (so exactly one process takes it, however many pass) and stops
itself with SIGSTOP. The test sees the file gone and the process stopped (`/proc/PID/stat`), then
strikes it, or another component while this one cannot move, and resumes it with SIGCONT.

| failpoint             | where the process stops                                            |
|-----------------------|--------------------------------------------------------------------|
| `trainer.leased`      | the trainer holds its step's groups (leased, read), not yet trained |
|                       | nor acked                                                          |
| `explorer.put_acked`  | the buffer acked an explorer's put; the explorer has not acted on   |
|                       | it (no CompleteTasks, no ExplorerStepDone)                         |
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import structlog

from .spawn import stat_fields

ENV = "TANDEM_FAILPOINTS"
NAMES = ("trainer.leased", "explorer.put_acked")

log = structlog.get_logger(__name__)


def reached(name: str) -> bool:
    """At failpoint `name`: stop this process if the failpoint is armed (True once resumed).
    One `os.environ` lookup when failpoints are off."""
    folder = os.environ.get(ENV)
    if not folder:
        return False
    try:
        os.unlink(Path(folder) / name)  # atomic: one process takes an armed failpoint
    except FileNotFoundError:
        return False
    os.kill(os.getpid(), signal.SIGSTOP)  # at once: the test sees it taken, then stopped
    log.warning("failpoint.resumed", failpoint=name, pid=os.getpid())
    return True


def arm(folder: Path, name: str) -> Path:
    """Arm failpoint `name` in `folder` (the value of `TANDEM_FAILPOINTS`) for one stop."""
    if name not in NAMES:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(NAMES)}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.touch()
    return path


def disarm(folder: Path, name: str) -> bool:
    """Disarm `name`; False when a process took it first (it is stopping, or stopped)."""
    try:
        os.unlink(folder / name)
        return True
    except FileNotFoundError:
        return False


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        return stat_fields(pid)[0] == "T"
    except (OSError, IndexError):  # gone
        return False
