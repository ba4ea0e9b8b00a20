"""The run dir is private: mode 0700, so every file of the run (journal, logs, traces, metrics,
checkpoints, stored experiences) is readable by the user who runs it and by no one else,
whatever mode the code that writes a file inside gives it (docs/reliability.md, "no secret on
disk"). A run dir that already exists is made private too: it is the run's, not a shared
folder."""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE = 0o700


def private_run_dir(run_dir: str | Path) -> Path:
    """Create `run_dir` (and missing parents) if needed and make it 0700; returns it."""
    path = Path(run_dir)
    path.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != PRIVATE:
        os.chmod(path, PRIVATE)
    return path
