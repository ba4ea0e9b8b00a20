"""How long each of `tandem up`'s components took to come up, and the invocation end to end.

A component is up when the run can use it: the master, buffer and reward service when their
socket answers an RPC, the trainer and each explorer when the master lists them as registered
(imports, model load and registration included). Seconds count from the moment `tandem up`
started its process.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from tandem.common.errors import PeerDead, RequestFailed

POLL = 0.1  # seconds between probes while something is still coming up


def process_age() -> float:
    """Seconds since this process started (its interpreter start-up and imports included)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux: count from here
        return 0.0


class StartupClock:
    """Process start to ready, per component name."""

    def __init__(self) -> None:
        self.invoked = time.monotonic() - process_age()
        self.started: dict[str, float] = {}
        self.ready: dict[str, float] = {}

    def process_started(self, name: str) -> None:
        self.started.setdefault(name, time.monotonic())  # a restart is not a start-up

    def mark_ready(self, name: str) -> None:
        if name in self.started and name not in self.ready:
            self.ready[name] = time.monotonic() - self.started[name]

    def from_status(self, status: Any) -> None:
        for component in status.components:
            self.mark_ready(component.name)

    def pending(self) -> list[str]:
        return [name for name in self.started if name not in self.ready]

    async def probe(self, name: str, client: Any, request: Any, deadline: float) -> None:
        """Call `request` until `client`'s peer answers (a refusal is an answer too)."""
        while name not in self.ready and time.monotonic() < deadline:
            try:
                await client.call(request, timeout=POLL * 5, retries=0)
            except RequestFailed:
                pass
            except PeerDead:
                continue
            self.mark_ready(name)

    async def watch_registry(self, master: Any, request: Any, deadline: float) -> None:
        """Poll the master's registry until every started component is listed."""
        while self.pending() and time.monotonic() < deadline:
            try:
                self.from_status(await master.call(request, timeout=POLL * 5, retries=0))
            except (PeerDead, RequestFailed):
                pass
            await asyncio.sleep(POLL)

    def rows(self, run_seconds: float | None) -> list[tuple[str, str]]:
        ready = ", ".join(f"{name} {self.ready[name]:.1f}" if name in self.ready
                          else f"{name} never" for name in self.started)
        end_to_end = time.monotonic() - self.invoked
        rows = [("start-up seconds", ready), ("end to end", f"{end_to_end:.1f} s")]
        if run_seconds is not None:
            rows.append(("outside the run", f"{max(0.0, end_to_end - run_seconds):.1f} s"))
        return rows
