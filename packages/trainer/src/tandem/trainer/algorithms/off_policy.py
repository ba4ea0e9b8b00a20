"""The trainer/engine mismatch of one step's sampled tokens, and the importance weights between
the proximal policy (the trainer's weights before the update) and the behaviour policy (the
engine that sampled), for the decoupled objective and truncated importance sampling."""

from __future__ import annotations

import torch
from torch import Tensor

from .kl import kl_estimate
from .masked import masked_mean

_LOG_CLAMP = 20.0


def behaviour_weights(proximal: Tensor, behaviour: Tensor, mask: Tensor,
                      cap: float | None) -> Tensor:
    """exp(proximal - behaviour) per token, truncated at `cap`; no gradient."""
    with torch.no_grad():
        weights = torch.exp((proximal - behaviour).clamp(-_LOG_CLAMP, _LOG_CLAMP)) * mask
        return weights.clamp(max=cap) if cap is not None else weights


def mismatch_metrics(trainer: Tensor, behaviour: Tensor, mask: Tensor,
                     cap: float | None) -> dict[str, Tensor]:
    """How far the engine's logprobs of the sampled tokens are from the trainer's own, computed
    before any update of the step (so they measure the mismatch, not learning).

    With r = exp(trainer - behaviour) per action token (the importance ratio):
    `mismatch/kl` is the k3 estimate of KL(behaviour || trainer), r - 1 - log r, unbiased and
    >= 0 since the tokens were sampled from the behaviour policy; `mismatch/kl_k1` the k1
    estimate, mean(behaviour - trainer); `mismatch/ratio_{mean,max,min}`; and, with a cap,
    `mismatch/truncated_frac`, the share of tokens whose ratio exceeds it. Each a masked mean
    (max, min) over the action tokens.
    """
    with torch.no_grad():
        trainer, behaviour = trainer.detach().float(), behaviour.float()
        ratio = torch.exp((trainer - behaviour).clamp(-_LOG_CLAMP, _LOG_CLAMP))
        on = ratio[mask > 0]
        one = ratio.new_ones(())
        metrics = {
            "mismatch/kl": masked_mean(kl_estimate(behaviour, trainer, "k3"), mask),
            "mismatch/kl_k1": masked_mean(behaviour - trainer, mask),
            "mismatch/ratio_mean": masked_mean(ratio, mask),
            "mismatch/ratio_max": on.max() if on.numel() else one,
            "mismatch/ratio_min": on.min() if on.numel() else one,
        }
        if cap is not None:
            metrics["mismatch/truncated_frac"] = masked_mean((ratio > cap).float(), mask)
    return metrics
