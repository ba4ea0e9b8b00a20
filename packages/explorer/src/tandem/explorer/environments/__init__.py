"""Environments for multi-turn workflows, by registry name."""

from .base import Environment, Outcome, Reply
from .calculator import Calculator
from .guess_number import GuessNumber

ENVIRONMENTS: dict[str, type[Environment]] = {
    Calculator.name: Calculator,
    GuessNumber.name: GuessNumber,
}


def get_environment(name: str) -> type[Environment]:
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise ValueError(
            f"unknown environment {name!r}; choose one of {sorted(ENVIRONMENTS)}") from None


__all__ = ["ENVIRONMENTS", "Calculator", "Environment", "GuessNumber", "Outcome", "Reply",
           "get_environment"]
