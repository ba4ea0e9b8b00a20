"""`lookup`: a reward function class by name, tandem's own (registered lazily by
`tandem.reward.builtins`) or a plugin's.

`lookup` lives here, not beside `register` in `base`, so that the functions import `base` and
nothing imports back.
"""

from tandem.common.plugins import REWARDS, load_installed

from ..base import RewardFunction


def lookup(name: str) -> type[RewardFunction]:
    """The reward function class registered as `name`; a clear error naming the known ones."""
    load_installed()
    if name not in REWARDS:
        raise KeyError(f"unknown reward function {name!r}; registered: "
                       f"{', '.join(REWARDS.names())}")
    cls = REWARDS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, RewardFunction)):
        raise TypeError(f"reward function {name!r} ({REWARDS.entry(name).plugin}) is "
                        f"{cls!r}, not a PureReward or AsyncReward subclass")
    if not cls.name:
        cls.name = name
    return cls
