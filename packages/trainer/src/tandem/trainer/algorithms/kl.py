"""Estimators of KL(policy || reference) per token, from log-probabilities of sampled tokens.

With log_ratio = logp - ref_logp (tokens sampled from the policy):
  k1 = log_ratio                          unbiased, can be negative
  k2 = log_ratio**2 / 2                   biased, low variance
  k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, always >= 0 (Schulman's estimator)
"""

from __future__ import annotations

import torch
from torch import Tensor

_CLAMP = 20.0


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    log_ratio = (logp - ref_logp).clamp(-_CLAMP, _CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"trainer.kl.estimator: unknown {estimator!r}; use k1, k2 or k3")
