"""Advantage estimators: from rewards (and values) to a per-token advantage.

All take an `AdvantageInputs` and the trainer config and return `Advantages`. Outcome-reward
estimators (grpo, dr_grpo, rloo) give every action token of a sequence the same advantage;
reinforce_pp and gae work per token. `token_rewards` carries per-token terms such as a KL
penalty placed in the reward; the outcome estimators add their sum to the sequence reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from tandem.common.config import TrainerConfig

from .masked import group_stats, masked_whiten, outcome_on_last_token
from .registry import Registry


@dataclass
class AdvantageInputs:
    rewards: Tensor                       # [B] scalar reward of each sequence
    groups: Tensor                        # [B] long, group index of each sequence
    mask: Tensor                          # [B, T] float, 1 on action tokens
    token_rewards: Tensor | None = None   # [B, T] per-token reward terms (KL penalty)
    values: Tensor | None = None          # [B, T] value estimates before the update (gae)


@dataclass
class Advantages:
    advantages: Tensor                    # [B, T], zero off the mask
    returns: Tensor | None = None         # [B, T] value targets (gae)


AdvantageFn = Callable[[AdvantageInputs, TrainerConfig], Advantages]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator", "trainer.advantage")


def _sequence_rewards(inp: AdvantageInputs) -> Tensor:
    if inp.token_rewards is None:
        return inp.rewards
    return inp.rewards + (inp.token_rewards * inp.mask).sum(-1)


def _per_token(seq_advantage: Tensor, mask: Tensor) -> Tensor:
    return seq_advantage[:, None] * mask


@ADVANTAGES.register("grpo")
def grpo(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """(r - group mean) / (group std + eps), the std unbiased; a group of one gets 0."""
    r = _sequence_rewards(inp)
    mean, std, _ = group_stats(r, inp.groups)
    return Advantages(_per_token((r - mean) / (std + cfg.std_eps), inp.mask))


@ADVANTAGES.register("dr_grpo")
def dr_grpo(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """Dr. GRPO: r - group mean, without the std scaling that favours easy and hard groups."""
    r = _sequence_rewards(inp)
    mean, _, _ = group_stats(r, inp.groups)
    return Advantages(_per_token(r - mean, inp.mask))


@ADVANTAGES.register("rloo")
def rloo(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """r minus the mean of the other responses of the group: n/(n-1) (r - mean); 0 alone."""
    r = _sequence_rewards(inp)
    mean, _, count = group_stats(r, inp.groups)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return Advantages(_per_token((r - mean) * scale, inp.mask))


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reverse discounted sum over action tokens; non-action tokens are skipped, not cut."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running * m
    return returns


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """REINFORCE++: per-token discounted returns, whitened over the whole batch (no groups)."""
    rewards = outcome_on_last_token(inp.rewards, inp.mask)
    if inp.token_rewards is not None:
        rewards = rewards + inp.token_rewards * inp.mask
    returns = _discounted_returns(rewards, inp.mask, cfg.gamma)
    return Advantages(masked_whiten(returns, inp.mask, cfg.std_eps))


@ADVANTAGES.register("gae")
def gae(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """PPO's generalised advantage estimation over action tokens, whitened over the batch."""
    if inp.values is None:
        raise ValueError("gae needs value estimates (the trainer's value head)")
    mask, values = inp.mask, inp.values
    rewards = outcome_on_last_token(inp.rewards, mask)
    if inp.token_rewards is not None:
        rewards = rewards + inp.token_rewards * mask
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
    returns = (advantages + values) * mask
    return Advantages(masked_whiten(advantages, mask, cfg.std_eps), returns)
