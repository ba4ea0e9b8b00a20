"""tandem-reward: reward functions and the reward service.

    from tandem.reward import LocalScorer
    async with LocalScorer(functions={"math": 1.0, "format": 0.1}) as scorer:
        scores = await scorer.score(items)      # list[ScoreItem] -> list[Score]

`build_scorer(config.reward, config.transport)` gives the LocalScorer or, when
`reward.service` is set, a RemoteScorer talking to `tandem-reward` (RewardService).
"""

from .base import REGISTRY, AsyncReward, PureReward, RewardFunction, register, result
from .functions import lookup
from .pool import WorkerPool
from tandem.common.sandbox import Run, Sandbox
from .scorer import LocalScorer, RemoteScorer, Scorer, build_scorer
from .service import RewardService

__all__ = [
    "REGISTRY", "AsyncReward", "LocalScorer", "PureReward", "RemoteScorer", "RewardFunction",
    "RewardService", "Run", "Sandbox", "Scorer", "WorkerPool", "build_scorer", "lookup",
    "register", "result",
]
