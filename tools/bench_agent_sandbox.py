"""What running each `agent` episode in its own sandbox costs: the wall time from handing an
episode to `AgentSandbox.play` to its result, for an agent that returns at once (so the figure
is the process's start, its imports of `openai` and the agent, and its teardown), one at a time
and `--concurrent` at once.

    .venv/bin/python tools/bench_agent_sandbox.py --episodes 8 --concurrent 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this module: the agent below


async def bench(episodes: int, concurrent: int) -> None:
    from tandem.explorer.workflows.agent_sandbox import AgentSandbox, AgentSandboxArgs

    sandbox = AgentSandbox("bench_agent_sandbox:returns", AgentSandboxArgs(), timeout=60,
                           max_retries=0, slots=concurrent)
    await sandbox.start()

    async def one() -> float:
        t0 = time.monotonic()
        played = await sandbox.play("ep-bench", "http://127.0.0.1:9/v1", {})
        assert played.reason == "ok", played.reason
        return time.monotonic() - t0

    try:
        serial = [await one() for _ in range(episodes)]
        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(episodes)))
        wall = time.monotonic() - t0
    finally:
        await sandbox.close()
    print(f"one at a time: median {statistics.median(serial):.2f} s per episode "
          f"(min {min(serial):.2f}, max {max(serial):.2f}, {episodes} episodes)")
    print(f"{concurrent} at once: {episodes} episodes in {wall:.2f} s "
          f"({wall / episodes:.2f} s each)")


async def returns(task: dict, client) -> float:
    return 1.0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(bench(args.episodes, args.concurrent))
