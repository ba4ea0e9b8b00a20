"""`tandem up`'s start-up clock: process start to ready per component, and the invocation's
end-to-end time counted from this process's own start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

from backstop import BACKSTOP
from tandem.common.errors import PeerDead
from tandem.master.startup import StartupClock, process_age


def test_process_age_counts_from_the_interpreter_start():
    # pytest has imported a lot before this test: the process is older than this call
    assert 0.0 < process_age()
    assert StartupClock().invoked <= time.monotonic() - process_age() + 0.5
    # a process started after `began` is younger than the time since (/proc counts in ticks)
    began = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", "from tandem.master.startup import process_age; "
                               "print(process_age())"],
        capture_output=True, text=True, timeout=BACKSTOP, check=True)
    assert 0.0 < float(child.stdout) <= time.monotonic() - began + 0.02


def test_ready_is_counted_once_from_the_first_start():
    clock = StartupClock()
    clock.process_started("trainer")
    clock.process_started("explorer-0")
    time.sleep(0.05)
    clock.process_started("trainer")  # a restart is not a start-up
    clock.from_status(SimpleNamespace(components=[SimpleNamespace(name="trainer"),
                                                  SimpleNamespace(name="stranger")]))
    assert clock.ready["trainer"] >= 0.05 and "stranger" not in clock.ready
    assert clock.pending() == ["explorer-0"]
    first = clock.ready["trainer"]
    clock.mark_ready("trainer")
    assert clock.ready["trainer"] == first
    rows = dict(clock.rows(run_seconds=0.01))
    assert rows["start-up seconds"].startswith(f"trainer {first:.1f}") and "explorer-0 never" in \
        rows["start-up seconds"]
    assert float(rows["end to end"].split()[0]) >= float(rows["outside the run"].split()[0])


def test_probe_waits_for_an_answer_and_gives_up_at_its_deadline():
    class Peer:
        def __init__(self, silent_for: int):
            self.calls, self.silent_for = 0, silent_for

        async def call(self, request, timeout, retries):
            self.calls += 1
            if self.calls <= self.silent_for:
                raise PeerDead("buffer", "not yet")
            return "ok"

    clock = StartupClock()
    clock.process_started("buffer")
    clock.process_started("reward")
    peer = Peer(silent_for=2)
    asyncio.run(clock.probe("buffer", peer, object(), time.monotonic() + BACKSTOP))
    assert peer.calls == 3 and "buffer" in clock.ready
    asyncio.run(clock.probe("reward", Peer(silent_for=10**9), object(), time.monotonic() + 0.05))
    assert "reward" not in clock.ready
