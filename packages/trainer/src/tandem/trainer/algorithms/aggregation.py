"""Loss aggregation: how per-token losses become one number, exactly across micro-batches.

The denominators (`total_tokens`, `total_seqs`) are those of the whole step's batch, so the
micro-batch losses of one step add up to the loss of the batch taken at once, whatever the
micro-batch split or the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Aggregator:
    mode: str                       # token_mean | seq_mean_token_sum | seq_mean_token_mean
    total_tokens: float | None = None
    total_seqs: float | None = None

    def __call__(self, values: Tensor, mask: Tensor) -> Tensor:
        if self.mode == "token_mean":
            denom = self.total_tokens if self.total_tokens is not None else mask.sum().clamp(min=1)
            return (values * mask).sum() / denom
        seqs = self.total_seqs if self.total_seqs is not None else mask.shape[0]
        per_seq = (values * mask).sum(-1)
        if self.mode == "seq_mean_token_sum":
            return per_seq.sum() / seqs
        if self.mode == "seq_mean_token_mean":
            return (per_seq / mask.sum(-1).clamp(min=1)).sum() / seqs
        raise ValueError(f"trainer.aggregation: unknown mode {self.mode!r}")

    def sequences(self, per_seq: Tensor, count: int | None = None) -> Tensor:
        """Mean of per-sequence (or per-pair) losses over `count` (default the batch's seqs)."""
        denom = count if count is not None else (
            self.total_seqs if self.total_seqs is not None else per_seq.shape[0])
        return per_seq.sum() / denom
