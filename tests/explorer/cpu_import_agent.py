"""An agent whose module spends 2.5 s of CPU while it imports (standing for heavy imports), for
tests/explorer/test_agent_isolation.py: its episode's CPU limit counts from the call."""

import time

_until = time.process_time() + 2.5
while time.process_time() < _until:
    pass


async def instant(task: dict, client) -> float:
    return 1.0


async def spins(task: dict, client) -> float:
    while True:
        pass
