"""Length shaping of sequence rewards (DAPO's overlong reward shaping, a linear length penalty)
and DAPO's overlong filtering, before the advantages.

With |y| the response's action tokens, L_max the token cap and L_cache the buffer:

  overlong(y) = 0                                   |y| <= L_max - L_cache
              = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
              = -1                                  |y| > L_max
  reward += overlong_penalty * overlong(y) - penalty * |y| / L_max

Overlong filtering (`filter_truncated`) masks the loss of a response cut at the cap: its tokens
leave the mask (and the aggregation's denominator), its reward stays in its group's statistics.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from tandem.common.config.trainer import LengthShapingConfig


def overlong(lengths: Tensor, max_tokens: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment in [-1, 0], per sequence (float64)."""
    lengths = lengths.double()
    if buffer <= 0:
        return torch.where(lengths > max_tokens, -1.0, 0.0).double()
    start = max_tokens - buffer
    soft = (start - lengths) / buffer
    return torch.where(lengths <= start, 0.0, torch.where(lengths <= max_tokens, soft, -1.0))


def length_shaping(batch, cfg: LengthShapingConfig, max_tokens: int):
    """The batch with shaped rewards (and truncated rows masked), and what was done."""
    lengths = batch.mask.sum(-1)
    shaping = torch.zeros_like(lengths, dtype=torch.float64)
    if cfg.overlong_buffer > 0:
        shaping += cfg.overlong_penalty * overlong(lengths, max_tokens, cfg.overlong_buffer)
    if cfg.penalty > 0:
        shaping -= cfg.penalty * lengths.double() / max_tokens
    rewards = (batch.rewards.double() + shaping).to(batch.rewards.dtype)
    metrics = {"length/shaping_mean": float(shaping.mean()),
               "length/truncated_frac": float(batch.truncated.float().mean())}
    mask = batch.mask
    if cfg.filter_truncated:
        mask = mask * (~batch.truncated).to(mask.dtype)[:, None]
        metrics["length/filtered"] = float(batch.truncated.sum())
    return replace(batch, rewards=rewards, mask=mask), metrics
