"""Which groups carry a group-relative learning signal (DAPO's dynamic sampling).

A group whose rewards are all equal gets an advantage of 0 on every response under GRPO and its
relatives: it costs a forward and backward pass and teaches nothing. The explorer counts the
informative groups of each batch it rolls out (`ExplorerStepDone.informative`), the master tops a
step up with more tasks until it has enough (`trainer.dynamic_sampling`), and the trainer drops
the others; all three use this one definition.
"""

from __future__ import annotations

from collections.abc import Iterable

from .messages.experience import Experience

INFORMATIVE_TOL = 1e-6  # rewards closer than this count as equal


def informative_groups(experiences: Iterable[Experience], tol: float = INFORMATIVE_TOL) -> int:
    """How many groups among `experiences` have rewards that differ by more than `tol`."""
    spans: dict[str, tuple[float, float]] = {}
    for e in experiences:
        lo, hi = spans.get(e.group_id, (e.reward, e.reward))
        spans[e.group_id] = (min(lo, e.reward), max(hi, e.reward))
    return sum(1 for lo, hi in spans.values() if hi - lo > tol)
