"""tandem-master: the run's clock (sync plan, task leases, registry, barriers, journal) and the
umbrella `tandem` command.

Public API (imported on first use, so `tandem --help` stays instant):

- `Master` (`service`): the component; `await Master(config).serve()`, then `close()`.
- `RunClock` (`clock`): the sync plan applied to live counters, no sockets.
- `TaskDispatcher`, `load_rows` (`taskset`): the taskset, its order and its leases.
- `simulate`, `Timeline` (`simulate`): what `tandem plan` replays.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Master": "service", "RunClock": "clock",
    "TaskDispatcher": "taskset", "load_rows": "taskset", "simulate": "simulate",
    "Timeline": "simulate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tandem.master' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
