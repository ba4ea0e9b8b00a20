"""Experience factories and a served Buffer for the buffer tests (conftest puts this folder on
sys.path)."""

from __future__ import annotations

import asyncio

import numpy as np
from backstop import BACKSTOP
from processes import until
from tandem.buffer import Buffer
from tandem.common.config import load_config
from tandem.common.messages import Experience, experience_id, group_id
from tandem.common.rpc import RpcClient


def make_experience(task: str, index: int, version: int = 0, *, reward: float = 0.0,
                    tokens: int = 12, prompt_len: int = 4, explorer: str = "explorer-0",
                    info: dict | None = None, seed: int | None = None) -> Experience:
    """One experience of `task` (repeat `index`) under `version`, with random arrays."""
    rng = np.random.default_rng(seed if seed is not None else hash((task, index, version)) % 2**32)
    response = tokens - prompt_len
    return Experience(
        id=experience_id(task, index, version, explorer),
        task_id=task, group_id=group_id(task, version),
        tokens=rng.integers(0, 50_000, tokens, dtype=np.int32), prompt_len=prompt_len,
        action_mask=rng.integers(0, 2, response, dtype=np.uint8),
        logprobs=rng.standard_normal(response).astype(np.float32),
        reward=reward, policy_version=version, explorer=explorer, info=info or {})


def make_group(task: str, size: int, version: int = 0, rewards: list[float] | None = None,
               **kwargs) -> list[Experience]:
    rewards = rewards or [float(i) for i in range(size)]
    return [make_experience(task, i, version, reward=rewards[i], **kwargs) for i in range(size)]


class Clock:
    """A settable clock for lease expiry."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def config_for(tmp_path, *overrides):
    return load_config(None, [f"run_dir={tmp_path}", "buffer.synchronous=normal", *overrides])


class Running:
    """A Buffer serving on a random port, and a client talking to it."""

    def __init__(self, config):
        self.buffer = Buffer(config, address="tcp://127.0.0.1:0")

    async def __aenter__(self):
        address = await self.buffer.start()
        self.serving = asyncio.create_task(self.buffer.serve())
        self.client = RpcClient(address, peer="buffer", name="test")
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        self.buffer.request_stop()
        await self.serving
        await self.buffer.close()

    async def call(self, msg, timeout=BACKSTOP, ttl=None):
        """One attempt; `ttl` (default `timeout`) is the time the buffer is told it may take."""
        return await self.client.call(msg, timeout=timeout, retries=0, ttl=ttl,
                                      timeout_key="test")


async def parked(b: Running, n: int = 1) -> None:
    """Until the buffer holds `n` waiting samples (its own state, not a guess in seconds)."""
    await until(lambda: sum(map(len, b.buffer._parked.values())) >= n, f"{n} waiting samples")
