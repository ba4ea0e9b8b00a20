"""A tandem CLI running as a real process in a test, its JSON log lines read as they come.

`tests/conftest.py` puts this folder on sys.path: `from component_process import ComponentProcess`.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time

from backstop import BACKSTOP


class ComponentProcess:
    """A tandem CLI process; its JSON log lines (stderr) are drained by a thread."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self.raw: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, event: str, timeout: float = BACKSTOP) -> dict:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.raw.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.events.append(record)
            if record.get("event") == event:
                return record
        raise AssertionError(f"{self.name} did not log {event} within {timeout}s (exit code "
                             f"{self.proc.poll()}); last lines:\n{''.join(self.raw[-15:])}")

    def stop(self, timeout: float = BACKSTOP) -> int:
        """SIGTERM, then SIGKILL if it has not exited `timeout` s later (a hang); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
