"""Timed spans from every component, appended to `run_dir/trace/<component>.jsonl`.

A span is one line: component, kind (rollout, train, sync, wait, ...), step, version, start,
end (unix seconds) and free attributes. Lines are buffered and flushed at most every
`flush_interval` seconds and on close, so tracing is cheap enough to leave on; a reader
(`tandem timeline`) tolerates a torn last line of a process that was killed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator


class Tracer:
    """Writes spans for one component; disabled (a no-op) when `run_dir` is None."""

    def __init__(self, run_dir: str | Path | None, component: str, *, flush_interval: float = 1.0):
        self.component = component
        self.flush_interval = flush_interval
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._file = None
        # called with (kind, seconds, attrs) for every span, written or not (Prometheus reads
        # step, wait and sync durations from here)
        self.observers: list[Callable[[str, float, dict[str, Any]], None]] = []
        if run_dir is not None:
            path = Path(run_dir) / "trace" / f"{component}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, kind: str, start: float, end: float, *, step: int | None = None,
               version: int | None = None, **attrs: Any) -> None:
        """Append one finished span (times are `time.time()` seconds)."""
        for observe in self.observers:
            observe(kind, end - start, attrs)
        if self._file is None:
            return
        event = {"component": self.component, "kind": kind, "step": step, "version": version,
                 "start": round(start, 6), "end": round(end, 6), "pid": os.getpid()}
        if attrs:
            event["attrs"] = attrs
        line = json.dumps(event, separators=(",", ":"), default=str)
        with self._lock:
            self._lines.append(line)
            if time.monotonic() - self._last_flush >= self.flush_interval:
                self._flush_locked()

    def event(self, kind: str, *, step: int | None = None, version: int | None = None,
              **attrs: Any) -> None:
        """An instant (zero-length span), e.g. buffer fill level or a weights announcement."""
        now = time.time()
        self.record(kind, now, now, step=step, version=version, **attrs)

    @contextmanager
    def span(self, kind: str, *, step: int | None = None, version: int | None = None,
             **attrs: Any) -> Iterator[dict[str, Any]]:
        """Time the block; attributes added to the yielded dict are written with the span."""
        extra: dict[str, Any] = {}
        start = time.time()
        try:
            yield extra
        finally:
            self.record(kind, start, time.time(), step=step, version=version, **attrs, **extra)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._file is not None and self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every span of a run, sorted by start; torn or foreign lines are skipped."""
    spans: list[dict[str, Any]] = []
    for path in sorted((Path(run_dir) / "trace").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                span = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(span, dict) and "kind" in span and "start" in span:
                spans.append(span)
    spans.sort(key=lambda s: (s["start"], s.get("end", s["start"])))
    return spans


class JsonlTail:
    """Follows growing JSONL files (traces, logs, eval rows) of a live run: each call returns the
    JSON objects a file gained since the last call. A line still being written waits for the next
    call; torn or non-object lines and unreadable files yield nothing."""

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}

    def new_objects(self, path: Path) -> list[dict[str, Any]]:
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._offsets[path] = offset + end
        objects = []
        for line in chunk[:end].splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                objects.append(obj)
        return objects


def read_logs(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every JSON log event the run's components wrote (run_dir/logs/*.jsonl), each with
    `_file` naming the component's log; torn or foreign lines are skipped."""
    tail = JsonlTail()
    events: list[dict[str, Any]] = []
    for path in sorted((Path(run_dir) / "logs").glob("*.jsonl")):
        for event in tail.new_objects(path):
            event["_file"] = path.stem
            events.append(event)
    return events
