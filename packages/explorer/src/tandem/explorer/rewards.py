"""One interface to reward functions: in this process (`tandem.reward`) or the reward service.

A `RewardScorer` scores a batch of `ScoreItem`s and returns one `Score` per item, in order. Items
name no function, so the scorer applies the run's `reward.functions` (weighted sum, each
function's score a named component); a workflow may pass `fn`/`functions` per item instead.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from tandem.common.messages.reward import Score, ScoreBatch, ScoreItem


class RewardScorer(Protocol):
    async def score(self, items: list[ScoreItem]) -> list[Score]: ...

    async def close(self) -> None: ...


class InProcessScorer:
    """The reward functions of `tandem.reward` (its `LocalScorer`), run in this process."""

    def __init__(self, reward_config: Any):
        try:
            from tandem.reward import LocalScorer
        except ImportError:
            raise RuntimeError(
                "reward functions in-process need tandem-reward installed "
                "(pip install tandem-explorer[reward]); or set reward.service: true") from None
        self._scorer = LocalScorer(config=reward_config)

    async def score(self, items: list[ScoreItem]) -> list[Score]:
        return list(await self._scorer.score(items))

    async def close(self) -> None:
        await self._scorer.close()


class ServiceScorer:
    """The reward service over RPC (`reward.score`), in requests of at most `reward.max_batch`."""

    def __init__(self, reward_config: Any, transport: Any = None, *, name: str = "explorer"):
        from tandem.common.rpc import RpcClient

        self.config = reward_config
        self.client = RpcClient(reward_config.address, peer="reward", transport=transport,
                                name=name)

    async def score(self, items: list[ScoreItem]) -> list[Score]:
        size = self.config.max_batch
        replies = await asyncio.gather(*(
            self.client.call(ScoreBatch(items=items[i:i + size]),
                             timeout=self.config.request_timeout, retries=0,
                             timeout_key="reward.request_timeout")
            for i in range(0, len(items), size)))
        scores = [s for reply in replies for s in reply.scores]
        if len(scores) != len(items):
            raise RuntimeError(
                f"reward service returned {len(scores)} scores for {len(items)} items")
        return scores

    async def close(self) -> None:
        await self.client.close()


def create_scorer(reward_config: Any, transport: Any = None, *,
                  name: str = "explorer") -> RewardScorer:
    """The service when `reward.service` is set, else the functions in this process."""
    if reward_config.service:
        return ServiceScorer(reward_config, transport, name=name)
    return InProcessScorer(reward_config)
