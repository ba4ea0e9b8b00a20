"""PPO's value head: a linear layer on the policy's last hidden state, and its clipped loss."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ValueHead(nn.Module):
    """V(state before token t+1) from the hidden state at position t."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.proj(hidden).squeeze(-1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
               clip: float | None) -> tuple[Tensor, Tensor]:
    """Per-token 0.5 * max((V - R)^2, (V_clipped - R)^2) and whether the clipped term won."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
