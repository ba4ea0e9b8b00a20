"""Importance weights between the proximal policy (the trainer's weights before the update) and
the behaviour policy (the engine that sampled), for the decoupled objective and for truncated
importance sampling of the trainer/engine mismatch."""

from __future__ import annotations

import torch
from torch import Tensor

from .kl import kl_estimate
from .masked import masked_mean


def behaviour_weights(proximal: Tensor, behaviour: Tensor, mask: Tensor,
                      cap: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """exp(proximal - behaviour) per token, truncated at `cap`; no gradient. Returns metrics."""
    with torch.no_grad():
        log_w = (proximal - behaviour).clamp(-20.0, 20.0)
        weights = torch.exp(log_w) * mask
        on = weights[mask > 0]
        none = weights.new_zeros(())
        metrics = {
            "off_policy/behaviour_weight_mean": masked_mean(weights, mask),
            "off_policy/behaviour_weight_max": on.max() if on.numel() else none,
            "off_policy/behaviour_weight_min": on.min() if on.numel() else none,
            "off_policy/mismatch_kl": masked_mean(kl_estimate(behaviour, proximal, "k3"), mask),
        }
        if cap is not None:
            metrics["off_policy/truncated_frac"] = masked_mean((weights > cap).float(), mask)
            weights = weights.clamp(max=cap)
    return weights, metrics
