"""One interface to reward functions: in this process (`tandem.reward`) or the reward service
(`tandem.common.reward_client.RemoteScorer`).

A `RewardScorer` scores a batch of `ScoreItem`s and returns one `Score` per item, in order. Items
name no function, so the scorer applies the run's `reward.functions` (weighted sum, each
function's score a named component); a workflow may pass `fn`/`functions` per item instead.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Protocol

from tandem.common.errors import TandemError
from tandem.common.messages.reward import Score, ScoreItem
from tandem.common.reward_client import RemoteScorer


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

    async def start(self) -> None:
        """Start the functions' worker processes (and any sandbox or model) now rather than
        at the first score; a failure here is raised again, and reported, by that score."""
        await self._scorer.start()

    @property
    def stats(self) -> dict[str, dict[str, float]]:
        """Running totals per function: evaluated, timeouts, errors, seconds."""
        return self._scorer.stats

    async def close(self) -> None:
        await self._scorer.close()


def create_scorer(reward_config: Any, transport: Any = None, *,
                  name: str = "explorer") -> RewardScorer:
    """The service when `reward.service` is set, else the functions in this process."""
    if reward_config.service:
        return RemoteScorer.from_config(reward_config, transport, name=name)
    return InProcessScorer(reward_config)
