"""The gradient a trainer step hands its optimizer: what an equivalence of micro-batch splits
(or of any two ways to accumulate one batch) is about.

Comparing parameters after the step instead compares through AdamW, whose first update is
about lr * g / |g|: a gradient near 0 whose rounding differs between two summation orders (or
between two CPUs' kernels: AVX2 against AVX-512, issue 31) moves its parameter by up to lr in
either direction, so a parameter check needed a tolerance of lr and still failed on a machine
whose kernels sum in another order. The gradients themselves agree to float32 rounding of the
largest contribution, on any machine.
"""

from __future__ import annotations

import torch


def step_with_grads(learner, batch) -> tuple[dict, dict[str, torch.Tensor]]:
    """`learner.step(batch)`'s metrics and each parameter's gradient as its optimizer got it
    (after clipping), captured by the optimizer's own step pre-hook."""
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in learner.actor.model.named_parameters()}

    def capture(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads[names[id(p)]] = p.grad.detach().clone()

    handle = learner.optimizer.register_step_pre_hook(capture)
    try:
        metrics = learner.step(batch)
    finally:
        handle.remove()
    assert grads, "the step never reached its optimizer"
    return metrics, grads


def assert_same_gradient(g1: dict[str, torch.Tensor], g2: dict[str, torch.Tensor],
                         rel: float = 1e-4) -> None:
    """Every parameter's gradient equal within `rel` of itself, plus float32 rounding of the
    largest gradient entry (a near-0 entry is a sum of terms that cancel)."""
    assert g1.keys() == g2.keys()
    scale = max(float(g.abs().max()) for g in g1.values())
    assert scale > 0, "no gradient at all: nothing to compare"
    for name, grad in g1.items():
        torch.testing.assert_close(grad, g2[name], rtol=rel, atol=1e-6 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")
