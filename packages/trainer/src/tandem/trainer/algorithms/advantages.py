"""Advantage estimators: from rewards (and values) to a per-token advantage.

All take an `AdvantageInputs` and the trainer config and return `Advantages`; each is
registered in `tandem.common.plugins.ADVANTAGES` by `tandem.trainer.builtins`. Outcome-reward
estimators (grpo, dr_grpo, rloo) give every action token of a sequence the same advantage;
reinforce_pp and gae work per token. `token_rewards` carries per-token terms such as a KL
penalty placed in the reward; the outcome estimators add their sum to the sequence reward.

Every estimator computes in float64 and returns the inputs' dtype. A group (or, for the
whitening estimators, a batch) whose values are all equal gets exactly 0, decided by comparing
the values themselves: in float32, 16 rewards of 0.7 leave `r - mean` and `std` at ~1e-7 of
rounding noise, which `(r - mean) / (std + eps)` would amplify to ~0.1 on every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch
from torch import Tensor

from tandem.common.config import TrainerConfig

from .masked import outcome_on_last_token


@dataclass
class AdvantageInputs:
    rewards: Tensor                       # [B] scalar reward of each sequence
    groups: Tensor                        # [B] long, group index of each sequence
    mask: Tensor                          # [B, T] float, 1 on action tokens
    token_rewards: Tensor | None = None   # [B, T] per-token reward terms (KL penalty)
    values: Tensor | None = None          # [B, T] value estimates before the update (gae)
    logprobs: Tensor | None = None        # [B, T] the student's logprobs of the samples (distill)
    teacher: Tensor | None = None         # [B, T] the teacher's logprobs of them (distill)


@dataclass
class Advantages:
    advantages: Tensor                    # [B, T], zero off the mask
    returns: Tensor | None = None         # [B, T] value targets (gae)


AdvantageFn = Callable[[AdvantageInputs, TrainerConfig], Advantages]


def _sequence_rewards(inp: AdvantageInputs) -> Tensor:
    """The sequence rewards in float64 (plus the masked sum of the per-token terms)."""
    r = inp.rewards.double()
    if inp.token_rewards is None:
        return r
    return r + (inp.token_rewards.double() * inp.mask.double()).sum(-1)


def _per_token(seq_advantage: Tensor, mask: Tensor) -> Tensor:
    return (seq_advantage[:, None] * mask.double()).to(mask.dtype)


def group_stats64(values: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row, in float64: its group's mean, unbiased std (0 alone), size, and whether every
    value of the group is exactly equal (then the caller's advantage is exactly 0)."""
    values = values.double()
    num = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(num, dtype=torch.float64, device=values.device).index_add_(
        0, groups, torch.ones_like(values))
    mean = torch.zeros_like(count).index_add_(0, groups, values) / count.clamp(min=1)
    dev2 = torch.zeros_like(count).index_add_(0, groups, (values - mean[groups]) ** 2)
    std = (dev2 / (count - 1).clamp(min=1)).sqrt()
    low = torch.full_like(count, float("inf")).scatter_reduce(0, groups, values, "amin")
    high = torch.full_like(count, float("-inf")).scatter_reduce(0, groups, values, "amax")
    equal = low == high
    return mean[groups], std[groups], count[groups], equal[groups]


def whiten64(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries in float64, unbiased std; exactly 0
    everywhere when the masked entries are all equal. Returns the mask's dtype."""
    x, m = values.double(), mask.double()
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    picked = x[mask > 0]
    if picked.numel() == 0 or bool(picked.min() == picked.max()):
        return torch.zeros_like(values, dtype=mask.dtype)
    return ((x - mean) / (var.sqrt() + eps) * m).to(mask.dtype)


def grpo(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """(r - group mean) / (group std + eps), the std unbiased; a group of one gets 0."""
    r = _sequence_rewards(inp)
    mean, std, _, equal = group_stats64(r, inp.groups)
    adv = torch.where(equal, 0.0, (r - mean) / (std + cfg.std_eps))
    return Advantages(_per_token(adv, inp.mask))


def dr_grpo(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """Dr. GRPO: r - group mean, without the std scaling that favours easy and hard groups."""
    r = _sequence_rewards(inp)
    mean, _, _, equal = group_stats64(r, inp.groups)
    return Advantages(_per_token(torch.where(equal, 0.0, r - mean), inp.mask))


def rloo(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """r minus the mean of the other responses of the group: n/(n-1) (r - mean); 0 alone."""
    r = _sequence_rewards(inp)
    mean, _, count, equal = group_stats64(r, inp.groups)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return Advantages(_per_token(torch.where(equal, 0.0, (r - mean) * scale), inp.mask))


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reverse discounted sum over action tokens; non-action tokens are skipped, not cut."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running * m
    return returns


def reinforce_pp(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """REINFORCE++: per-token discounted returns, whitened over the whole batch (no groups)."""
    mask = inp.mask.double()
    rewards = outcome_on_last_token(inp.rewards.double(), mask)
    if inp.token_rewards is not None:
        rewards = rewards + inp.token_rewards.double() * mask
    returns = _discounted_returns(rewards, mask, cfg.gamma)
    return Advantages(whiten64(returns, inp.mask, cfg.std_eps))


def gae(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """PPO's generalised advantage estimation over action tokens, whitened over the batch."""
    if inp.values is None:
        raise ValueError("gae needs value estimates (the trainer's value head)")
    mask, values = inp.mask.double(), inp.values.double()
    rewards = outcome_on_last_token(inp.rewards.double(), mask)
    if inp.token_rewards is not None:
        rewards = rewards + inp.token_rewards.double() * mask
    advantages = torch.zeros_like(values)
    last_gae = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards[:, t] + cfg.gamma * next_value - values[:, t]
        step = delta + cfg.gamma * cfg.lam * last_gae
        last_gae = torch.where(m, step, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = step * m
    returns = ((advantages + values) * mask).to(inp.values.dtype)
    return Advantages(whiten64(advantages, inp.mask, cfg.std_eps), returns)
