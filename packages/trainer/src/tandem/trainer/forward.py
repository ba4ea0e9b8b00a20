"""Log-probabilities (and entropy, values) of the target tokens from one forward pass.

The definition matches the explorer's behaviour log-probability (tandem.explorer.sampling):
log_softmax(logits / temperature)[token]; a temperature of 0 (greedy) means the model's own
distribution. Top-k / top-p truncation is re-applied only with `trainer.sampler_truncation`
(`Truncation`, per row, in the explorer's order: temperature, top-k, then top-p); without it,
behaviour and trainer logprobs differ on a truncated sampler, by the mass cut off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tandem.weights.vision import ImageInputs, restrict, rope_positions, unsampleable_ids


@dataclass
class Truncation:
    """The sampler's top-k / top-p of each row ([B] tensors; top_k 0 and top_p 1 are off)."""

    top_k: Tensor   # [B] long
    top_p: Tensor   # [B] float

    def to(self, device) -> Truncation:
        return Truncation(self.top_k.to(device), self.top_p.to(device))


@torch.no_grad()
def truncation_mask(logits: Tensor, targets: Tensor, trunc: Truncation) -> Tensor:
    """[B, T, V] bool, True where the sampler's top-k / top-p cut a token out of the support.

    The same rule as `tandem.explorer.sampling.policy_logprobs`: top-k keeps the k largest,
    then top-p the smallest prefix (by probability under the top-k logits) whose mass reaches
    p, the top token always. The target token is always kept: the sampler drew it, and a
    trainer whose logits moved may rank it just outside its own nucleus, where its logprob
    would be -inf."""
    z = logits.detach()
    drop = torch.zeros_like(z, dtype=torch.bool)
    k = trunc.top_k[:, None, None]
    vocab = z.shape[-1]
    if bool(((trunc.top_k > 0) & (trunc.top_k < vocab)).any()):
        kmax = int(trunc.top_k.clamp(max=vocab).max())
        top = torch.topk(z, kmax, dim=-1).values  # [B, T, kmax], descending
        index = (k.clamp(min=1, max=vocab) - 1).expand(*z.shape[:-1], 1)
        kth = top.gather(-1, index.clamp(max=kmax - 1))
        drop |= (z < kth) & (k > 0) & (k < vocab)
    if bool((trunc.top_p < 1.0).any()):
        zk = z.masked_fill(drop, float("-inf"))
        sorted_z, order = torch.sort(zk, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= trunc.top_p[:, None, None]
        drop_sorted[..., 0] = False
        drop |= torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    drop.scatter_(-1, targets.unsqueeze(-1), False)
    return drop


@dataclass
class ForwardOut:
    logprobs: Tensor               # [B, L-1]
    entropy: Tensor | None = None  # [B, L-1]
    values: Tensor | None = None   # [B, L-1]


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                   entropy: str | None = None, truncation: Truncation | None = None
                   ) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target under softmax(logits / T), without a [.., V] log_softmax copy;
    with `truncation`, under the sampler's top-k / top-p support (`truncation_mask`).

    `entropy`: None, "metric" (computed without a graph) or "loss" (differentiable), of the
    distribution the logprob is taken under.
    """
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    if truncation is not None:
        logits = logits.masked_fill(truncation_mask(logits, targets, truncation), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if entropy == "loss":
        p = torch.softmax(logits, dim=-1)
        ent = lse - (p * logits.masked_fill(p == 0, 0.0)).sum(-1)  # a cut token adds 0, not nan
    elif entropy == "metric":
        # H = lse - sum(p * z) with p = exp(z - lse): one vocabulary-sized buffer, reused in place
        with torch.no_grad():
            z, m = logits.detach(), lse.detach()
            if truncation is not None:
                z = z.masked_fill(z == float("-inf"), torch.finfo(z.dtype).min)
            ent = m - (z - m.unsqueeze(-1)).exp_().mul_(z).sum(-1)
    return logp, ent


class Actor(nn.Module):
    """The policy (a Hugging Face causal LM) and, for GAE, its value head: one module to wrap."""

    def __init__(self, model: nn.Module, value_head: nn.Module | None = None,
                 fp32_logits: bool = False):
        super().__init__()
        self.model = model
        self.value_head = value_head
        self.fp32_logits = fp32_logits
        # a vision-language model's placeholder tokens, which its engine never samples
        self.unsampleable = unsampleable_ids(model.config)

    def forward(self, tokens: Tensor, attention: Tensor, temperature: float = 1.0,
                entropy: str | None = None, truncation: Truncation | None = None,
                images: ImageInputs | None = None) -> ForwardOut:
        if images is not None:
            logits, hidden = vision_logits(self.model, tokens, attention, images,
                                           hidden=self.value_head is not None)
        elif self.fp32_logits:
            hidden = self.model.get_decoder()(input_ids=tokens, attention_mask=attention,
                                              use_cache=False).last_hidden_state
            # out of autocast: the fp32 lm_head weight on fp32 hidden states, fp32 logits
            with torch.autocast(tokens.device.type, enabled=False):
                logits = self.model.get_output_embeddings()(hidden.float())
        else:
            out = self.model(input_ids=tokens, attention_mask=attention, use_cache=False,
                             output_hidden_states=self.value_head is not None)
            logits, hidden = out.logits, (out.hidden_states[-1] if self.value_head else None)
        if self.unsampleable:
            logits = restrict(logits, torch.tensor(self.unsampleable))
        logp, ent = token_logprobs(logits[:, :-1], tokens[:, 1:], temperature, entropy,
                                   truncation)
        values = None
        if self.value_head is not None:
            values = self.value_head(hidden[:, :-1].float())
        return ForwardOut(logp, ent, values)


def vision_logits(model: nn.Module, tokens: Tensor, attention: Tensor, images: ImageInputs,
                  hidden: bool = False) -> tuple[Tensor, Tensor | None]:
    """Logits (and the last hidden state) of a vision-language batch: the rows' images in row
    order fill their placeholders, at the model's multimodal positions, as the engine saw them."""
    images = images.to(tokens.device)
    positions, _ = rope_positions(model, tokens, attention, images)
    out = model(input_ids=tokens, attention_mask=attention, position_ids=positions,
                pixel_values=images.pixel_values.to(next(model.parameters()).dtype),
                image_grid_thw=images.grid_thw, use_cache=False, output_hidden_states=hidden)
    return out.logits, (out.hidden_states[-1] if hidden else None)
