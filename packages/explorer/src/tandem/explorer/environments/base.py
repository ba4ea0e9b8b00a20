"""An environment of a multi-turn episode: it sets the task, answers the model, and scores it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class Reply:
    """The environment's answer to one model turn: text appended to the episode, or the end."""

    text: str = ""
    done: bool = False


@dataclass
class Outcome:
    """How the episode scored: the reward and its named components."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    reason: str = ""


class Environment(ABC):
    """One episode's world, built from one task's payload.

    The model's turn ends at one of `stop` (or eos, or its token limit); `step` gets the text of
    that turn and returns what is appended (tokens the model did not produce: action_mask 0) or
    that the episode is over. `outcome` is the verifier, called once at the end.
    """

    name: ClassVar[str]
    stop: ClassVar[tuple[str, ...]] = ()

    def __init__(self, payload: dict[str, Any]):
        self.payload = payload

    @abstractmethod
    def instructions(self) -> str:
        """The first user message: the task and how to act in this environment."""

    @abstractmethod
    def step(self, action: str) -> Reply:
        """React to one model turn."""

    @abstractmethod
    def outcome(self) -> Outcome:
        """Score the episode (called once, when it is over for any reason)."""
