"""The built-in reward functions; importing this package registers them, `lookup` finds one.

`lookup` lives here, not beside `register` in `base`, so that the functions import `base` and
nothing imports back.
"""

from ..base import REGISTRY, RewardFunction
from . import code_tests, format, k12, math_answer, reward_model, vision  # noqa: F401


def lookup(name: str) -> type[RewardFunction]:
    """The reward function class registered as `name`; a clear error naming the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward function {name!r}; known: {sorted(REGISTRY)}") from None
