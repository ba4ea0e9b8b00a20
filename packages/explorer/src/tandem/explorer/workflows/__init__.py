"""Workflows by registry name (`explorers[i].workflow`)."""

from typing import Any

from .agent import Agent
from .base import (
    RolloutContext, Trajectory, Workflow, WorkflowArgs, make_experience, settle_group_versions)
from .multi_turn import MultiTurn
from .single_turn import SingleTurn

WORKFLOWS: dict[str, type[Workflow]] = {"single_turn": SingleTurn, "multi_turn": MultiTurn,
                                        "agent": Agent}


def create_workflow(name: str, tokenizer: Any, args: dict[str, Any] | None = None) -> Workflow:
    try:
        cls = WORKFLOWS[name]
    except KeyError:
        raise ValueError(f"unknown workflow {name!r}; choose one of {sorted(WORKFLOWS)}") from None
    return cls(tokenizer, args)


__all__ = ["WORKFLOWS", "Agent", "MultiTurn", "RolloutContext", "SingleTurn", "Trajectory", "Workflow",
           "WorkflowArgs", "create_workflow", "make_experience", "settle_group_versions"]
