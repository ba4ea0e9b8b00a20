"""Workflows by registry name (`explorers[i].workflow`): tandem's own (`builtins`) and every
plugin's, in `tandem.common.plugins.WORKFLOWS`.

A workflow entry may declare what the explorer must give it: `scorer=True` (the reward scorer in
`RolloutContext.scorer`), `endpoint=True` (the explorer's OpenAI endpoint, `RolloutContext.endpoint`).
"""

from dataclasses import dataclass
from typing import Any

from tandem.common.plugins import WORKFLOWS, load_installed

from .agent import Agent
from .base import (
    RolloutContext, Trajectory, Workflow, WorkflowArgs, make_experience, settle_group_versions)
from .multi_turn import MultiTurn
from .single_turn import SingleTurn


@dataclass(frozen=True)
class WorkflowNeeds:
    """What a registered workflow declares it needs from the explorer."""

    scorer: bool = False
    endpoint: bool = False


def create_workflow(name: str, tokenizer: Any, args: dict[str, Any] | None = None) -> Workflow:
    load_installed()
    if name not in WORKFLOWS:
        raise ValueError(WORKFLOWS.unknown(name, "workflow"))
    cls = WORKFLOWS.get(name, "workflow")
    return cls(tokenizer, args)


def workflow_needs(name: str) -> WorkflowNeeds:
    load_installed()
    declares = WORKFLOWS.declares(name, "workflow")
    return WorkflowNeeds(scorer=bool(declares.get("scorer")),
                         endpoint=bool(declares.get("endpoint")))


__all__ = ["WORKFLOWS", "Agent", "MultiTurn", "RolloutContext", "SingleTurn", "Trajectory",
           "Workflow", "WorkflowArgs", "WorkflowNeeds", "create_workflow", "make_experience",
           "settle_group_versions", "workflow_needs"]
