"""The master's run journal: one JSON line per input, appended, replayed on restart.

Lines are written and flushed to the OS before the decision they cause goes out, so a master
that is killed loses nothing another process saw; `fsync` runs in the background at most every
`sync_interval` seconds, which bounds what a machine crash can lose. A torn last line (killed
mid-write) is skipped on replay.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import structlog

log = structlog.get_logger(__name__)


class Journal:
    """Append-only JSONL file of the master's inputs."""

    def __init__(self, path: str | Path, *, sync_interval: float = 1.0):
        self.path = Path(path)
        self.sync_interval = sync_interval
        self._file = None
        self._dirty = False
        self._last_sync = time.monotonic()

    def replay(self) -> Iterator[dict[str, Any]]:
        """Every complete record written so far, in order."""
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        for lineno, line in enumerate(lines, 1):
            if not line.endswith("\n"):
                log.warning("journal.torn_line", path=str(self.path), line=lineno)
                break
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                log.warning("journal.bad_line", path=str(self.path), line=lineno)

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            with open(self.path, "rb+") as f:  # cut a torn last line so appends stay parseable
                data = f.read()
                if data and not data.endswith(b"\n"):
                    f.truncate(data.rfind(b"\n") + 1)
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, kind: str, **fields: Any) -> None:
        record = {"k": kind, "t": round(time.time(), 6), **fields}
        self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self._file.flush()
        self._dirty = True

    def maybe_sync(self) -> None:
        """fsync if something was appended since the last one, at most every `sync_interval`
        seconds; safe to call from a worker thread while the loop keeps appending."""
        file = self._file
        if file is not None and self._dirty and (
                time.monotonic() - self._last_sync >= self.sync_interval):
            self._dirty = False
            self._last_sync = time.monotonic()
            try:
                os.fsync(file.fileno())
            except (OSError, ValueError):  # closed meanwhile: close() synced it
                pass

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
