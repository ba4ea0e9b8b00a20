"""An agent whose module never finishes importing, for tests/explorer/test_agent_isolation.py."""

import time

time.sleep(3600)


async def never(task: dict, client) -> float:
    return 1.0
