"""Masked reductions and group statistics shared by the algorithms."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries, with the unbiased (n - 1) std."""
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    var = (((values - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (values - mean) / (var.sqrt() + eps) * mask


def group_stats(values: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row mean, unbiased std (0 for a group of one) and size of the row's group."""
    num = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(num, dtype=values.dtype, device=values.device).index_add_(
        0, groups, torch.ones_like(values))
    total = torch.zeros_like(count).index_add_(0, groups, values)
    mean = total / count
    dev2 = torch.zeros_like(count).index_add_(0, groups, (values - mean[groups]) ** 2)
    std = (dev2 / (count - 1).clamp(min=1)).sqrt()
    return mean[groups], std[groups], count[groups]


def last_action_index(mask: Tensor) -> Tensor:
    """Index of each row's last action token (0 for a row without any)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * (mask > 0)).argmax(dim=-1)


def outcome_on_last_token(rewards: Tensor, mask: Tensor) -> Tensor:
    """A [B, T] tensor holding each sequence's reward on its last action token."""
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    out[torch.arange(mask.shape[0], device=mask.device), last_action_index(mask)] = rewards
    return out * mask
