"""Policy losses. Each takes `PolicyInputs`, the trainer config and an `Aggregator` and returns
(the loss of this micro-batch, metrics as 0-d tensors averaged over its action tokens). Each is
registered in `tandem.common.plugins.POLICY_LOSSES` by `tandem.trainer.builtins` with its
`LossNeeds`, and gets exactly what it declares: `ref_logprobs` only with `reference`, pairs only
with `pairs`, `advantages` only with `advantages`, `values` only with `value_head`; its own
parameters are `cfg.loss.params`, an instance of the model it declares.

`old_logprobs` is the clip anchor: the behaviour log-probabilities from the engine, or the
proximal ones the trainer recomputed before the update (`trainer.off_policy.proximal`).
`weights`, when given, multiplies every token's loss (the behaviour importance weight of the
decoupled objective / truncated IS); it carries no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.common.config import TrainerConfig

from .aggregation import Aggregator
from .masked import masked_mean


@dataclass
class PolicyInputs:
    logprobs: Tensor                   # [B, T] current policy, with gradient
    old_logprobs: Tensor               # [B, T] clip anchor, no gradient
    advantages: Tensor | None          # [B, T]; None for a loss that declares advantages=False
    mask: Tensor                       # [B, T] float, 1 on action tokens
    weights: Tensor | None = None      # [B, T] behaviour importance weights, no gradient
    ref_logprobs: Tensor | None = None # [B, T] frozen reference (needs.reference)
    values: Tensor | None = None       # [B, T] value head predictions, with gradient (value_head)


PolicyLossFn = Callable[[PolicyInputs, TrainerConfig, Aggregator], tuple[Tensor, dict[str, Tensor]]]

_LOG_RATIO_CLAMP = 20.0


def _weighted(token_loss: Tensor, inp: PolicyInputs) -> Tensor:
    return token_loss if inp.weights is None else token_loss * inp.weights


def _clipped_objective(ratio: Tensor, inp: PolicyInputs, cfg: TrainerConfig
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """max(-A r, -A clip(r, 1-low, 1+high)), then min(., -A c) where A < 0 (dual clip)."""
    adv, mask = inp.advantages, inp.mask
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"policy/clip_frac": masked_mean((clipped > unclipped).float(), mask)}
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["policy/dual_clip_frac"] = masked_mean(dual.float(), mask)
    return loss, metrics


def _ratio_metrics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    on = mask > 0
    r = ratio.detach()
    return {
        "policy/ratio_mean": masked_mean(r, mask),
        "policy/ratio_max": r[on].max() if on.any() else r.new_ones(()),
        "policy/ratio_min": r[on].min() if on.any() else r.new_ones(()),
    }


def ppo_clip(inp: PolicyInputs, cfg: TrainerConfig, agg: Aggregator):
    """PPO's clipped surrogate with asymmetric bounds (DAPO clip-higher) and optional dual clip."""
    ratio = torch.exp((inp.logprobs - inp.old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    token_loss, metrics = _clipped_objective(ratio, inp, cfg)
    metrics.update(_ratio_metrics(ratio, inp.mask))
    return agg(_weighted(token_loss, inp), inp.mask), metrics


def gspo(inp: PolicyInputs, cfg: TrainerConfig, agg: Aggregator):
    """GSPO: the ratio is the sequence's length-normalised likelihood ratio.

    Written per token as s_i * exp(logp_t - sg(logp_t)) (GSPO-token): its value is the sequence
    ratio s_i on every token and its gradient s_i * grad(logp_t), so with seq_mean_token_mean
    aggregation this is exactly the sequence-level objective.
    """
    mask = inp.mask
    seq_log_ratio = ((inp.logprobs - inp.old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    seq_log_ratio = seq_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + inp.logprobs - inp.logprobs.detach())
    token_loss, metrics = _clipped_objective(ratio, inp, cfg)
    metrics.update(_ratio_metrics(ratio, mask))
    return agg(_weighted(token_loss, inp), mask), metrics


def policy_gradient(inp: PolicyInputs, cfg: TrainerConfig, agg: Aggregator):
    """Plain policy gradient (REINFORCE): -A * logp."""
    token_loss = -inp.advantages * inp.logprobs
    return agg(_weighted(token_loss, inp), inp.mask), {}


def cispo_clip(inp: PolicyInputs, cfg: TrainerConfig, agg: Aggregator):
    """CISPO (MiniMax-M1): REINFORCE with the importance weight clipped and stopped, so every
    token keeps its gradient and only its weight is bounded.

    loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t,  r_t = exp(logp_t - old_t)

    `eps_low` null (the paper's choice) leaves the weight unbounded below. PPO's clip drops the
    gradient of a token whose ratio left its range; here such a token keeps it, weighted.
    """
    params = cfg.loss.params
    ratio = torch.exp((inp.logprobs - inp.old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    ratio = ratio.detach()
    low = None if params.eps_low is None else 1.0 - params.eps_low
    weight = ratio.clamp(min=low, max=1.0 + params.eps_high)
    token_loss = -weight * inp.advantages * inp.logprobs
    metrics = {"policy/clip_frac": masked_mean((weight != ratio).float(), inp.mask),
               "cispo/weight_mean": masked_mean(weight, inp.mask)}
    metrics.update(_ratio_metrics(ratio, inp.mask))
    return agg(_weighted(token_loss, inp), inp.mask), metrics


def sft(inp: PolicyInputs, cfg: TrainerConfig, agg: Aggregator):
    """Supervised fine-tuning: cross-entropy (-logp) of the action tokens; advantages unused."""
    token_loss = -inp.logprobs
    return agg(token_loss, inp.mask), {"sft/nll": masked_mean(token_loss.detach(), inp.mask)}


def dpo(inp: PolicyInputs, cfg: TrainerConfig, agg: Aggregator):
    """DPO on pairs: rows are (chosen, rejected, chosen, rejected, ...); needs reference logprobs.
    `beta` is its parameter (`trainer.loss: {name: dpo, beta: 0.1}`).

    loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), pi and ref summed over the
    action tokens; the mean runs over the pairs of the whole step.
    """
    if inp.ref_logprobs is None:
        raise ValueError("dpo needs reference log-probabilities (a reference model)")
    if inp.mask.shape[0] % 2:
        raise ValueError("dpo needs rows in (chosen, rejected) pairs")
    mask = inp.mask
    policy = (inp.logprobs * mask).sum(-1).view(-1, 2)
    ref = (inp.ref_logprobs * mask).sum(-1).view(-1, 2)
    margin = cfg.loss.params.beta * ((policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1]))
    pair_loss = -F.logsigmoid(margin)
    pairs = None if agg.total_seqs is None else agg.total_seqs / 2
    metrics = {"dpo/margin": margin.detach().mean(), "dpo/accuracy": (margin > 0).float().mean()}
    return agg.sequences(pair_loss, pairs), metrics
