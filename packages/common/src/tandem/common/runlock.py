"""One process per component name and run dir: `run_dir/locks/<name>.lock`.

Two masters appending to one journal, two trainers writing one checkpoint folder, or two
explorers of one name sharing a log, a trace lane and a registry entry all corrupt a run
quietly. Every component CLI therefore holds its name's lock while it runs, and a second one
fails at once with a line that names the holder.

The lock is a POSIX record lock (`fcntl.lockf`): the kernel drops it when the process dies,
however it dies, and a child forked by the component (a worker pool) does not inherit it, so a
restarted component never finds its own lock held by an orphan.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Self

from .errors import TandemError
from .rundir import private_run_dir


class RunDirInUse(TandemError):
    """Another process already runs this component in this run dir."""


class RunDirLock:
    """`with RunDirLock(run_dir, "master"):` holds `run_dir/locks/master.lock`."""

    def __init__(self, run_dir: str | Path, name: str):
        self.run_dir = Path(run_dir)
        self.name = name
        self.path = self.run_dir / "locks" / f"{name}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        private_run_dir(self.run_dir)  # every component takes its lock first: none writes before
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUse(
                f"run dir {self.run_dir} is in use: another {self.name} (pid {holder}) holds "
                f"{self.path}; stop it, or give this run its own run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the record lock
            self._fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
