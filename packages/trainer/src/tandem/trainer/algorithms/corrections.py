"""Off-policy corrections: per-token weights and masks from the ratio of the proximal policy
(the trainer's weights before the update) to the behaviour policy (the engine that sampled).

With r_t = exp(proximal_t - behaviour_t) on action tokens and, per sequence i, the geometric
mean s_i = exp(mean_t log r_t) (GSPO's length-normalised sequence ratio):

  truncated_is   w_t = min(r_t, cap)                          (truncated IS, Espeholt et al.)
  masked_is      w_t = 1[lo <= r_t <= hi]                     (token-level masking/rejection)
  seq_is         w_t = min(s_i, cap)                          (sequence-level IS)
  seq_masked_is  w_t = 1[lo <= s_i <= hi]                     (sequence-level masking)
  icepop         w_t = r_t * 1[lo <= r_t <= hi]               (IcePop, Ring-1T: both tails)
  m2po           w_t = 1[t kept], the tokens with the largest (log r_t)^2 dropped until the
                 mean of (log r_t)^2 over those kept is <= bound   (M2PO, Zheng et al. 2025)

Each is registered in `tandem.common.plugins.CORRECTIONS` by `tandem.trainer.builtins` with its
params model; each takes `CorrectionInputs` and its params and returns the weights [B, T], zero
off the mask, without gradient. `apply_corrections` composes a list in order (the weights
multiply) and reports, per correction, `correction/<name>/masked_frac` (the share of action
tokens it set to 0), `/weight_mean`, `/weight_max` and `/ess`, the normalised effective sample
size (sum w)^2 / (n sum w^2) over the action tokens, 1 when every weight is equal.

A masked token's loss is multiplied by 0; it still counts in the aggregation's denominator, so
masking never enlarges the remaining tokens' step. The statistics run over the whole step's
batch (every rank holds it after the proximal pass), so every rank computes the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import torch
from torch import Tensor

_LOG_CLAMP = 20.0


@dataclass
class CorrectionInputs:
    proximal: Tensor    # [B, T] trainer logprobs before the update
    behaviour: Tensor   # [B, T] engine logprobs
    mask: Tensor        # [B, T] float, 1 on action tokens

    def log_ratio(self) -> Tensor:
        return ((self.proximal - self.behaviour) * self.mask).clamp(-_LOG_CLAMP, _LOG_CLAMP)

    def seq_log_ratio(self) -> Tensor:
        """[B, 1] mean log-ratio over each row's action tokens (log of the geometric mean)."""
        tokens = self.mask.sum(-1, keepdim=True).clamp(min=1)
        return (self.log_ratio() * self.mask).sum(-1, keepdim=True) / tokens


CorrectionFn = Callable[[CorrectionInputs, Any], Tensor]


def _band(ratio: Tensor, params: Any) -> Tensor:
    return ((ratio >= params.lo) & (ratio <= params.hi)).to(ratio.dtype)


def truncated_is(inp: CorrectionInputs, params: Any) -> Tensor:
    return inp.log_ratio().exp().clamp(max=params.cap) * inp.mask


def masked_is(inp: CorrectionInputs, params: Any) -> Tensor:
    return _band(inp.log_ratio().exp(), params) * inp.mask


def seq_is(inp: CorrectionInputs, params: Any) -> Tensor:
    return inp.seq_log_ratio().exp().clamp(max=params.cap) * inp.mask


def seq_masked_is(inp: CorrectionInputs, params: Any) -> Tensor:
    return _band(inp.seq_log_ratio().exp(), params) * inp.mask


def icepop(inp: CorrectionInputs, params: Any) -> Tensor:
    ratio = inp.log_ratio().exp()
    return ratio * _band(ratio, params) * inp.mask


def m2po(inp: CorrectionInputs, params: Any) -> Tensor:
    """Keep the n tokens of smallest squared log-ratio, n the largest whose mean is <= bound.

    Sorted ascending, the running mean of the first n squares never decreases with n, so the
    tokens kept are a prefix; ties are broken by position (a stable sort), so the choice is
    the same on every rank."""
    on = inp.mask > 0
    squares = inp.log_ratio()[on].double() ** 2
    keep = torch.zeros_like(squares, dtype=torch.bool)
    if squares.numel():
        ordered, order = torch.sort(squares, stable=True)
        running = ordered.cumsum(0) / torch.arange(1, len(ordered) + 1, dtype=ordered.dtype)
        kept = int((running <= params.bound).sum())
        keep[order[:kept]] = True
    weights = torch.zeros_like(inp.mask)
    weights[on] = keep.to(weights.dtype)
    return weights


def correction_metrics(name: str, weights: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """What one correction did to the batch: masked share, weight mean and max, ESS."""
    on = mask > 0
    w = weights[on].double()
    if not w.numel():
        return {}
    square = (w ** 2).sum()
    ess = w.sum() ** 2 / (len(w) * square) if square > 0 else w.new_zeros(())
    return {f"correction/{name}/masked_frac": (w == 0).double().mean(),
            f"correction/{name}/weight_mean": w.mean(),
            f"correction/{name}/weight_max": w.max(),
            f"correction/{name}/ess": ess}


def apply_corrections(corrections: list[tuple[str, CorrectionFn, Any]], inp: CorrectionInputs
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """The product of the corrections' weights, in order, and each one's metrics."""
    metrics: dict[str, Tensor] = {}
    with torch.no_grad():
        total = inp.mask.clone()
        for name, fn, params in corrections:
            weights = fn(inp, params).detach()
            metrics.update(correction_metrics(name, weights, inp.mask))
            total = total * weights
        if len(corrections) > 1:
            metrics.update(correction_metrics("all", total, inp.mask))
    return total, metrics
