"""Environments for multi-turn workflows, by registry name (`workflow_args.env`): tandem's own
(`builtins`) and every plugin's, in `tandem.common.plugins.ENVIRONMENTS`."""

from tandem.common.plugins import ENVIRONMENTS, load_installed

from .base import Environment, Outcome, Reply
from .calculator import Calculator
from .guess_number import GuessNumber


def get_environment(name: str) -> type[Environment]:
    load_installed()
    if name not in ENVIRONMENTS:
        raise ValueError(ENVIRONMENTS.unknown(name, "workflow_args.env"))
    return ENVIRONMENTS.get(name, "workflow_args.env")


__all__ = ["ENVIRONMENTS", "Calculator", "Environment", "GuessNumber", "Outcome", "Reply",
           "get_environment"]
