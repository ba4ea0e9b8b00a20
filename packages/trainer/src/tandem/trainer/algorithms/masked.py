"""Masked reductions shared by the algorithms."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def last_action_index(mask: Tensor) -> Tensor:
    """Index of each row's last action token (0 for a row without any)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * (mask > 0)).argmax(dim=-1)


def outcome_on_last_token(rewards: Tensor, mask: Tensor) -> Tensor:
    """A [B, T] tensor holding each sequence's reward on its last action token."""
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    out[torch.arange(mask.shape[0], device=mask.device), last_action_index(mask)] = rewards
    return out * mask
