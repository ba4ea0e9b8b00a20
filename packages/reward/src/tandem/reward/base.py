"""What a reward function is, and the registry that finds one by name.

Two kinds. A `PureReward` is a plain function of the item (math, k12, vision, format): cheap to
call, safe to run anywhere, and when `isolated` is set the scorer runs it in a worker process
that is killed if it overruns its time limit. An `AsyncReward` does its own waiting (the code
sandbox waits on a subprocess, the reward model on a batched forward pass) and is cancelled
when it overruns.
"""

from __future__ import annotations

from typing import ClassVar

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import Score, ScoreItem
from tandem.common.plugins import REWARDS

REGISTRY = REWARDS  # every reward function by name: tandem's own and every plugin's


def register(name: str, **declares):
    """Class decorator: make a reward function available under `name` (`reward.functions`,
    `workflow_args.reward_fn`), from tandem or from a plugin alike."""

    def add(cls: type[RewardFunction]) -> type[RewardFunction]:
        cls.name = name
        REWARDS.register(name, cls, **declares)
        return cls

    return add


def result(score: float, reason: str, **components: float) -> Score:
    """A function's answer: its score, why, and its named parts."""
    return Score(score=float(score), reason=reason,
                 components={k: float(v) for k, v in components.items()})


class RewardFunction:
    """Base of every reward function; `config` is the whole `reward` section."""

    name: ClassVar[str] = ""

    def __init__(self, config: RewardConfig):
        self.config = config


class PureReward(RewardFunction):
    """A function of the item alone; `isolated` ones run in killable worker processes."""

    isolated: ClassVar[bool] = False
    in_worker: bool = False  # set by the worker process, whose parent enforces the time limit

    def score(self, item: ScoreItem) -> Score:
        raise NotImplementedError

    def warm_up(self) -> None:
        """Pay this function's one-off costs (lazy imports, parser tables) now. The workers'
        template process calls it for each isolated function of `reward.functions` before it
        forks them, and for another before the first item that names it, so that the first
        item a fresh worker scores is not charged for them against `reward.timeout`."""


class AsyncReward(RewardFunction):
    """A reward that waits on something (a subprocess, a model); cancelled on timeout.

    With `one_per_worker`, at most `reward.workers` evaluations run at once and the time limit
    starts when one begins, not while it waits for its turn.
    """

    one_per_worker: ClassVar[bool] = False

    async def start(self) -> None:
        """Acquire what it needs (load a model, probe the sandbox) before the first item."""

    async def score(self, item: ScoreItem) -> Score:
        raise NotImplementedError

    async def close(self) -> None:
        """Release it; pending evaluations are cancelled by the caller first."""
