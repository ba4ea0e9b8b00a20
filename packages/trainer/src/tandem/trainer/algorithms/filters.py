"""Dynamic sampling (DAPO): a group whose rewards are all equal has zero group-relative
advantage and carries no learning signal; it can be dropped before the forward passes. The
same definition as the explorer's count (`tandem.common.groups`)."""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.common.groups import INFORMATIVE_TOL


def informative_rows(rewards: Tensor, groups: Tensor, tol: float = INFORMATIVE_TOL) -> tuple[Tensor, int]:
    """A [B] keep-mask of rows whose group's rewards differ, and how many groups were dropped."""
    num = int(groups.max()) + 1 if groups.numel() else 0
    hi = torch.full((num,), -torch.inf, dtype=rewards.dtype).scatter_reduce(
        0, groups, rewards, reduce="amax")
    lo = torch.full((num,), torch.inf, dtype=rewards.dtype).scatter_reduce(
        0, groups, rewards, reduce="amin")
    informative = (hi - lo) > tol
    present = torch.zeros(num, dtype=torch.bool)
    present[groups] = True
    dropped = int((present & ~informative).sum())
    return informative[groups], dropped
