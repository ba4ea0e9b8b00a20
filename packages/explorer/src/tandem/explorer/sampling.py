"""The sampling policy, and the one definition of a behaviour log-probability.

The distribution a token is sampled from, and whose log-probability an experience carries:

    z = logits / temperature                        (temperature > 0)
    z[i] = -inf for i outside the top_k largest     (top_k > 0)
    z[i] = -inf for i outside the smallest set whose
           probability under softmax(z) reaches top_p (top_p < 1; the top token is always kept)
    logprob(token) = log_softmax(z)[token]

With the defaults (top_k = 0, top_p = 1) this is `log_softmax(logits / temperature)`, which is
what a trainer computes from its own forward pass. With temperature 0 the token is the argmax and
its log-probability is taken under `log_softmax(logits)`, the model's own distribution.
A trainer that recomputes behaviour log-probabilities must apply the same steps in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (mirrors the `sampling` config section)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens whatever comes (benchmarks)
    top_logprobs: int = 0  # also return each token's most likely alternatives (the endpoint)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @classmethod
    def from_config(cls, section, **changes) -> SamplingParams:
        """From a `SamplingConfig` (or anything with the same attributes), with overrides."""
        values = dict(temperature=section.temperature, top_p=section.top_p, top_k=section.top_k,
                      max_tokens=section.max_tokens, stop=tuple(section.stop),
                      seed=getattr(section, "seed", None))
        values.update(changes)
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> dict[str, float]:
        """What a trainer needs to recompute the same distribution (stored in experience info)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def policy_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities over the vocabulary (last dim) under the sampling policy, in float32."""
    z = logits.float()
    if params.greedy:
        return torch.log_softmax(z, dim=-1)
    if params.temperature != 1.0:
        z = z / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; returns (tokens [B], their logprobs [B])."""
    tokens, logprobs, _ = sample_with_top(logits, params, generator)
    return tokens, logprobs


def sample_with_top(logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`sample_tokens`, plus the `params.top_logprobs` most likely tokens of each row under the
    same policy as (logprobs [B, k], ids [B, k]); None when not asked for."""
    logp = policy_logprobs(logits, params)
    if params.greedy:
        tokens = torch.argmax(logp, dim=-1)
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    top = None
    if params.top_logprobs:
        values, ids = torch.topk(logp, min(params.top_logprobs, logp.shape[-1]), dim=-1)
        top = (values, ids)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), top
