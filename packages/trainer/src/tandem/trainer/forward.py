"""Log-probabilities (and entropy, values) of the target tokens from one forward pass.

The definition matches the explorer's behaviour log-probability (tandem.explorer.sampling):
log_softmax(logits / temperature)[token]; a temperature of 0 (greedy) means the model's own
distribution. Top-k / top-p truncation is not re-applied: with them, behaviour and trainer
logprobs differ, which is what `trainer.off_policy.proximal` is for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class ForwardOut:
    logprobs: Tensor               # [B, L-1]
    entropy: Tensor | None = None  # [B, L-1]
    values: Tensor | None = None   # [B, L-1]


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                   entropy: str | None = None) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target under softmax(logits / T), without a [.., V] log_softmax copy.

    `entropy`: None, "metric" (computed without a graph) or "loss" (differentiable).
    """
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if entropy == "loss":
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    elif entropy == "metric":
        # H = lse - sum(p * z) with p = exp(z - lse): one vocabulary-sized buffer, reused in place
        with torch.no_grad():
            z, m = logits.detach(), lse.detach()
            ent = m - (z - m.unsqueeze(-1)).exp_().mul_(z).sum(-1)
    return logp, ent


class Actor(nn.Module):
    """The policy (a Hugging Face causal LM) and, for GAE, its value head: one module to wrap."""

    def __init__(self, model: nn.Module, value_head: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.value_head = value_head

    def forward(self, tokens: Tensor, attention: Tensor, temperature: float = 1.0,
                entropy: str | None = None) -> ForwardOut:
        out = self.model(input_ids=tokens, attention_mask=attention, use_cache=False,
                         output_hidden_states=self.value_head is not None)
        logp, ent = token_logprobs(out.logits[:, :-1], tokens[:, 1:], temperature, entropy)
        values = None
        if self.value_head is not None:
            values = self.value_head(out.hidden_states[-1][:, :-1].float())
        return ForwardOut(logp, ent, values)
