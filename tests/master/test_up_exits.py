"""`tandem up` sees a child's exit when it happens (its pidfd), not at its next 0.5 s poll: the
master's exit at the end of a run, and each exit of a staged stop (issue 27 item 4)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

from backstop import BACKSTOP
from tandem.master.up import Child, until_exit, wait_for_exit

WAITS_FOR_STDIN = [sys.executable, "-c", "import sys; sys.stdin.read()"]
UNREACHED = 2 * BACKSTOP  # a bound past the test's own: only the exit can end the wait in time


def child(tmp_path: Path) -> Child:
    c = Child("master", "master", WAITS_FOR_STDIN, tmp_path / "master.out")
    c.proc = subprocess.Popen(WAITS_FOR_STDIN, stdin=subprocess.PIPE)
    c._open_pidfd()
    return c


async def test_until_exit_returns_on_the_exit_not_at_its_bound(tmp_path):
    c = child(tmp_path)
    try:
        waiting = asyncio.ensure_future(until_exit([c], UNREACHED))
        await asyncio.sleep(0)
        assert not waiting.done()
        c.proc.stdin.close()  # the child exits on its own now
        await asyncio.wait_for(waiting, BACKSTOP)
        assert c.returncode == 0
    finally:
        c.close_pidfd()
        c.proc.kill()
        c.proc.wait(BACKSTOP)


def test_wait_for_exit_returns_on_the_exit(tmp_path):
    c = child(tmp_path)
    try:
        c.proc.stdin.close()
        waiting = threading.Thread(target=wait_for_exit, args=([c], UNREACHED), daemon=True)
        waiting.start()
        waiting.join(BACKSTOP)
        assert not waiting.is_alive(), "the exit did not wake wait_for_exit"
        assert c.returncode == 0
    finally:
        c.close_pidfd()
        c.proc.wait(BACKSTOP)
