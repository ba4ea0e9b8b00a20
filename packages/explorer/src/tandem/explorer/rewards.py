"""One interface to reward functions: in this process (`tandem.reward`) or the reward service.

A `RewardScorer` scores a batch of `ScoreItem`s and returns one `Score` per item, in order. Items
name no function, so the scorer applies the run's `reward.functions` (weighted sum, each
function's score a named component); a workflow may pass `fn`/`functions` per item instead.
"""

from __future__ import annotations

import asyncio
import math
from importlib.metadata import entry_points
from typing import Any, Protocol

from tandem.common.errors import ProtocolError, TandemError
from tandem.common.messages.reward import Score, ScoreBatch, ScoreItem


class RewardScorer(Protocol):
    async def score(self, items: list[ScoreItem]) -> list[Score]: ...

    async def close(self) -> None: ...


class InProcessScorer:
    """The reward functions run in this process: the scorer tandem-reward registers under the
    `tandem.scorers` entry point `local` (its `LocalScorer`), found by that name so the explorer
    never imports another component."""

    def __init__(self, reward_config: Any):
        found = entry_points(group="tandem.scorers", name="local")
        if not found:
            raise TandemError(
                "reward functions in-process need tandem-reward installed "
                "(pip install tandem-explorer[reward]); or set reward.service: true")
        local_scorer = next(iter(found)).load()
        self._scorer = local_scorer(config=reward_config)

    async def score(self, items: list[ScoreItem]) -> list[Score]:
        return list(await self._scorer.score(items))

    @property
    def stats(self) -> dict[str, dict[str, float]]:
        """Running totals per function: evaluated, timeouts, errors, seconds."""
        return self._scorer.stats

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
        # Resent (same request id, so the service scores it once) every reward.timeout: a
        # service killed with the request in flight never answers it, its restart does.
        attempts = max(1, math.ceil(self.config.request_timeout / self.config.timeout))
        replies = await asyncio.gather(*(
            self.client.call(ScoreBatch(items=items[i:i + size]),
                             timeout=self.config.request_timeout / attempts,
                             retries=attempts - 1, ttl=self.config.request_timeout,
                             timeout_key="reward.request_timeout")
            for i in range(0, len(items), size)))
        scores = [s for reply in replies for s in reply.scores]
        if len(scores) != len(items):
            raise ProtocolError(
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
