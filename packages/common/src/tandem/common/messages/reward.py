"""Reward protocol: explorers send batches of responses to a reward service for scoring."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .base import Message, Request, wire


class ScoreItem(BaseModel):
    """One response to score, by one reward function (`fn`), several by weight (`functions`),
    or, with neither, by the scorer's configured `reward.functions`."""

    model_config = ConfigDict(extra="forbid")
    fn: str | None = Field(default=None, description="registry name, e.g. math, code")
    functions: dict[str, float] | None = Field(
        default=None, description="registry name -> weight, combined as a weighted sum")
    prompt: str = ""
    response: str
    truth: Any = Field(default=None, description="gold answer / test cases, per function")
    args: dict[str, Any] = Field(default_factory=dict, description="per-function options")

    @model_validator(mode="after")
    def _one_selector(self) -> ScoreItem:
        if self.fn is not None and self.functions is not None:
            raise ValueError("give either fn or functions, not both")
        if self.functions is not None and not self.functions:
            raise ValueError("functions is empty; leave it out to use the scorer's defaults")
        return self


class Score(BaseModel):
    """The score of one item, its named components, and why."""

    model_config = ConfigDict(extra="forbid")
    score: float
    components: dict[str, float] = Field(
        default_factory=dict, description="each function's score by its name, and its parts "
                                          "as name.part")
    reason: str = Field(default="", description="short, e.g. 'correct', 'timeout', "
                                                "'3/5 tests passed'")


@wire("reward.score.reply")
class Scores(Message):
    """Reward service to explorer: one score per item, in order."""

    scores: list[Score]


@wire("reward.score", reply=Scores)
class ScoreBatch(Request):
    """Explorer to reward service: score these items."""

    LIMITS: ClassVar[dict[str, str]] = {"items": "reward.max_batch"}
    items: list[ScoreItem]


@wire("reward.stats.reply")
class RewardStats(Message):
    """Reward service to anyone: counters since start, per reward function."""

    requests: int
    items: int
    by_function: dict[str, dict[str, float]] = Field(
        description="name -> evaluated, timeouts, errors, seconds (summed)")
    workers: int


@wire("reward.stats", reply=RewardStats)
class GetRewardStats(Request):
    """Anyone to reward service: report counters."""
