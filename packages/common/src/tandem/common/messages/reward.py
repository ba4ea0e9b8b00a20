"""Reward protocol: explorers send batches of responses to a reward service for scoring."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .base import Message, Request, wire


class ScoreItem(BaseModel):
    """One response to score with reward function `fn`."""

    model_config = ConfigDict(extra="forbid")
    fn: str = Field(description="registry name of the reward function, e.g. math, code")
    prompt: str = ""
    response: str
    truth: Any = Field(default=None, description="gold answer / test cases, per function")
    args: dict[str, Any] = Field(default_factory=dict)


class Score(BaseModel):
    """The score of one item, its named components, and why."""

    model_config = ConfigDict(extra="forbid")
    score: float
    components: dict[str, float] = Field(default_factory=dict)
    reason: str = ""


@wire("reward.score.reply")
class Scores(Message):
    """Reward service to explorer: one score per item, in order."""

    scores: list[Score]


@wire("reward.score", reply=Scores)
class ScoreBatch(Request):
    """Explorer to reward service: score these items."""

    items: list[ScoreItem]
