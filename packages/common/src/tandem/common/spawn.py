"""Starting a subprocess from asyncio so that a cancel never leaves it running.

`asyncio.create_subprocess_exec` returns only once the process's pipes are connected to the
event loop, after the process already exists. A task cancelled in that window loses the
`Process` object, and with it the only way to stop the process: it runs on, unseen (a loaded
machine widens the window). `spawn` shields the creation; on a cancel it waits for the process,
hands it to `on_cancel` (which ends it), then lets the cancel go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any


async def spawn(*cmd: str, on_cancel: Callable[[asyncio.subprocess.Process], Awaitable[Any]],
                **kwargs: Any) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec(*cmd, **kwargs)`, never orphaned by a cancel."""
    creating = asyncio.ensure_future(asyncio.create_subprocess_exec(*cmd, **kwargs))
    try:
        return await asyncio.shield(creating)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await on_cancel(await creating)
        raise


async def kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL `proc` (if it still runs) and reap it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command: state, ppid, pgrp, session, ...;
    OSError or IndexError when the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, `stat_fields(pid)`) for every process now; one that exits while it is read is
    left out."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = stat_fields(int(entry.name))
        except (OSError, IndexError):
            continue
        yield int(entry.name), fields
