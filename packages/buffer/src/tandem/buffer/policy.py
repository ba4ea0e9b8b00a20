"""Group priority for the `priority` sampling policy: computed once, when a group completes."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def group_priority(kind: str, rewards: Sequence[float], infos: Sequence[dict[str, Any]],
                   key: str | None = None) -> float:
    """Priority of a complete group; higher is sampled first.

    - `reward_variance`: population variance of the rewards (a group whose responses all score
      the same teaches GRPO nothing).
    - `advantage`: mean |advantage|, taking `info["advantage"]` when every member has a number
      there, else reward minus the group's mean reward.
    - `key`: mean of `info[key]` over the members that have a number there (0 when none do).
    """
    n = len(rewards)
    if n == 0:
        return 0.0
    mean = sum(rewards) / n
    if kind == "reward_variance":
        return sum((r - mean) ** 2 for r in rewards) / n
    if kind == "advantage":
        given = [_as_float(info.get("advantage")) for info in infos]
        if given and all(a is not None for a in given):
            return sum(abs(a) for a in given) / len(given)  # type: ignore[arg-type]
        return sum(abs(r - mean) for r in rewards) / n
    if kind == "key":
        values = [v for info in infos if (v := _as_float(info.get(key or ""))) is not None]
        return sum(values) / len(values) if values else 0.0
    raise ValueError(f"unknown priority {kind!r}; choose reward_variance, advantage or key")
