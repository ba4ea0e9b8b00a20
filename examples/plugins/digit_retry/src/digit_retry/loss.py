"""The `cispo` policy loss: policy gradient with each token's importance weight capped and
kept out of the gradient, so no token's update is clipped away (CISPO).

    loss_t = -min(ratio_t, max_weight) * A_t * log pi(a_t)     (the weight without gradient)

PPO's clip drops the gradient of a token whose ratio left [1 - eps, 1 + eps]; here every token
keeps its gradient and only its weight is bounded. `max_weight` is the loss's parameter
(`trainer.loss: {name: cispo, max_weight: 2.0}`), checked by the model it declares
(`CispoParams` in `digit_retry.plugin`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.common.config import TrainerConfig
from tandem.trainer.algorithms import Aggregator, PolicyInputs


def cispo(inp: PolicyInputs, cfg: TrainerConfig, agg: Aggregator
          ) -> tuple[Tensor, dict[str, Tensor]]:
    max_weight = cfg.loss.params.max_weight
    ratio = torch.exp((inp.logprobs - inp.old_logprobs).clamp(-20.0, 20.0)).detach()
    weight = ratio.clamp(max=max_weight)
    if inp.weights is not None:  # the behaviour weight of an off-policy correction
        weight = weight * inp.weights
    token_loss = -weight * inp.advantages * inp.logprobs
    tokens = inp.mask.sum().clamp(min=1.0)
    capped = ((ratio > max_weight).float() * inp.mask).sum() / tokens
    return agg(token_loss, inp.mask), {"cispo/capped_frac": capped,
                                       "cispo/weight_mean": (weight * inp.mask).sum() / tokens}
