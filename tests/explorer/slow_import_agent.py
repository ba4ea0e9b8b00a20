"""An agent whose module takes 3 s to import (standing for heavy imports on a loaded machine),
for tests/explorer/test_agent_isolation.py: its episode's timeout counts from the call."""

import time

time.sleep(3.0)


async def instant(task: dict, client) -> float:
    return 1.0
