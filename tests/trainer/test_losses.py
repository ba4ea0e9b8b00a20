"""Every policy loss, KL estimator and correction on small hand-computed tensors: values and
gradients, with masked and padded positions that must not contribute."""

import math

import pytest
import torch

from tandem.common.config import TrainerConfig
from tandem.trainer.algorithms import (
    POLICY_LOSSES, Aggregator, PolicyInputs, behaviour_weights, kl_estimate, mismatch_metrics,
    value_loss)

LOG = math.log


def near(actual, expected):
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.detach().double(), expected)


def leaf(rows):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def cfg(**kw):
    return TrainerConfig(**kw)


def run(name, inp, config, mode="token_mean", **agg):
    loss, metrics = POLICY_LOSSES.get(name)(inp, config, Aggregator(mode, **agg))
    loss.backward()
    return loss.item(), metrics


# A padded second row: garbage logprobs and advantages under mask 0 must change nothing.
PAD_LOGP, PAD_ADV = 7.0, 50.0


def ppo_inputs(ratios, advs, logp=None):
    logp = leaf([[LOG(r) for r in ratios], [PAD_LOGP] * len(ratios)])
    return PolicyInputs(
        logprobs=logp, old_logprobs=torch.zeros_like(logp.detach()),
        advantages=t([advs, [PAD_ADV] * len(advs)]),
        mask=t([[1.0] * len(ratios), [0.0] * len(ratios)])), logp


def test_ppo_clip_values_gradients_and_padding():
    inp, logp = ppo_inputs([1.5, 0.5, 1.1], [1.0, -1.0, 1.0])
    loss, m = run("ppo_clip", inp, cfg())
    # token 0: max(-1.5, -1.2) = -1.2 (clipped), token 1: max(0.5, 0.8) = 0.8 (clipped),
    # token 2: inside the clip range, -1.1 with gradient -A * r = -1.1
    assert loss == pytest.approx((-1.2 + 0.8 - 1.1) / 3)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1 / 3])
    assert logp.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert m["policy/clip_frac"].item() == pytest.approx(2 / 3)
    assert m["policy/ratio_max"].item() == pytest.approx(1.5)
    assert m["policy/ratio_min"].item() == pytest.approx(0.5)


def test_ppo_clip_higher_is_asymmetric():
    inp, logp = ppo_inputs([1.5, 0.5], [1.0, -1.0])
    loss, _ = run("ppo_clip", inp, cfg(clip_low=0.2, clip_high=0.6))
    # the upper bound 1.6 no longer clips 1.5; the lower bound 0.8 still clips 0.5
    assert loss == pytest.approx((-1.5 + 0.8) / 2)
    assert logp.grad[0].tolist() == pytest.approx([-1.5 / 2, 0.0])


def test_ppo_dual_clip_bounds_negative_advantages():
    inp, logp = ppo_inputs([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, m = run("ppo_clip", inp, cfg(dual_clip=3.0))
    # A<0, r=5: max(5, 0.8) = 5 > c = 3 -> 3 (no gradient); r=2: 2 stays, gradient -A r = 2;
    # A>0, r=5: clipped to -1.2, dual clip does not apply
    assert loss == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.0 / 3, 0.0])
    assert m["policy/dual_clip_frac"].item() == pytest.approx(1 / 3)


def test_behaviour_weights_multiply_token_losses():
    inp, logp = ppo_inputs([1.1, 1.0], [1.0, 1.0])
    inp.weights = t([[2.0, 0.5], [9.0, 9.0]])
    loss, _ = run("ppo_clip", inp, cfg())
    assert loss == pytest.approx((-1.1 * 2.0 - 1.0 * 0.5) / 2)
    assert logp.grad[0].tolist() == pytest.approx([-1.1 * 2.0 / 2, -0.5 / 2])


def test_gspo_uses_the_sequence_ratio():
    logp = leaf([[LOG(2.0), 0.0], [PAD_LOGP, PAD_LOGP]])
    inp = PolicyInputs(logprobs=logp, old_logprobs=t([[0.0, 0.0], [0.0, 0.0]]),
                       advantages=t([[1.0, 1.0], [PAD_ADV, PAD_ADV]]), mask=t([[1, 1], [0, 0]]))
    loss, _ = run("gspo", inp, cfg(clip_high=0.5), "seq_mean_token_mean", total_seqs=1)
    s = math.sqrt(2.0)  # exp(mean(log 2, 0))
    assert loss == pytest.approx(-s)
    # d(-s)/d logp_t = -s / |y| for every token of the sequence
    assert logp.grad[0].tolist() == pytest.approx([-s / 2, -s / 2])
    assert logp.grad[1].tolist() == [0.0, 0.0]


def test_gspo_clips_whole_sequences():
    logp = leaf([[LOG(2.0), 0.0]])
    inp = PolicyInputs(logprobs=logp, old_logprobs=t([[0.0, 0.0]]),
                       advantages=t([[1.0, 1.0]]), mask=t([[1, 1]]))
    loss, m = run("gspo", inp, cfg(clip_high=0.2), "seq_mean_token_mean")
    assert loss == pytest.approx(-1.2)
    assert logp.grad.tolist() == [[0.0, 0.0]]
    assert m["policy/clip_frac"].item() == 1.0


def test_pg_and_sft():
    logp = leaf([[-1.0, -2.0], [PAD_LOGP, PAD_LOGP]])
    inp = PolicyInputs(logprobs=logp, old_logprobs=torch.zeros(2, 2, dtype=torch.float64),
                       advantages=t([[2.0, 2.0], [PAD_ADV, PAD_ADV]]), mask=t([[1, 1], [0, 0]]))
    loss, _ = run("pg", inp, cfg())
    assert loss == pytest.approx(-2.0 * (-1.0 - 2.0) / 2)
    assert logp.grad.tolist() == [[-1.0, -1.0], [0.0, 0.0]]
    logp.grad = None
    loss, m = run("sft", inp, cfg())
    assert loss == pytest.approx(1.5) and m["sft/nll"].item() == pytest.approx(1.5)
    assert logp.grad.tolist() == [[-0.5, -0.5], [0.0, 0.0]]


def test_dpo_pairs():
    # rows: chosen, rejected; the padded third column is masked
    logp = leaf([[-1.0, -1.0, PAD_LOGP], [-2.0, -2.0, PAD_LOGP]])
    ref = t([[-1.5, -1.5, 0.0], [-2.0, -2.0, 0.0]])
    inp = PolicyInputs(logprobs=logp, old_logprobs=ref, advantages=None,
                       mask=t([[1, 1, 0], [1, 1, 0]]), ref_logprobs=ref)
    loss, m = run("dpo", inp, cfg(loss={"name": "dpo", "beta": 1.0}))
    margin = (-2.0 + 3.0) - (-4.0 + 4.0)
    assert loss == pytest.approx(math.log1p(math.exp(-margin)))
    g = 1.0 / (1.0 + math.exp(margin))  # 1 - sigmoid(margin)
    near(logp.grad, [[-g, -g, 0.0], [g, g, 0.0]])
    assert m["dpo/accuracy"].item() == 1.0


def test_aggregation_modes_and_micro_batch_additivity():
    values = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert Aggregator("token_mean")(values, mask).item() == pytest.approx(10 / 4)
    assert Aggregator("seq_mean_token_sum")(values, mask).item() == pytest.approx(10 / 2)
    assert Aggregator("seq_mean_token_mean")(values, mask).item() == pytest.approx(3.0)
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        whole = Aggregator(mode)(values, mask)
        split = Aggregator(mode, total_tokens=4, total_seqs=2)
        parts = split(values[:1], mask[:1]) + split(values[1:], mask[1:])
        assert parts.item() == pytest.approx(whole.item())


def test_kl_estimators_values_and_gradients():
    ref = t([[LOG(0.25), 5.0]])
    mask = t([[1.0, 0.0]])
    # (value, d/dlogp) at log ratio log 2
    expected = {"k1": (LOG(2), 1.0), "k2": (0.5 * LOG(2) ** 2, LOG(2)),
                "k3": (0.5 - 1 + LOG(2), 0.5)}
    for name, (value, grad) in expected.items():
        logp = leaf([[LOG(0.5), -3.0]])
        kl = kl_estimate(logp, ref, name)
        (kl * mask).sum().backward()
        assert kl[0, 0].item() == pytest.approx(value)
        near(logp.grad, [[grad, 0.0]])
        same = kl_estimate(ref, ref, name)
        assert same.abs().max().item() == 0.0


def test_behaviour_weights_truncate():
    prox = t([[LOG(0.5), LOG(0.5), 0.0]])
    behav = t([[LOG(0.25), LOG(0.5), 3.0]])
    mask = t([[1, 1, 0]])
    near(behaviour_weights(prox, behav, mask, cap=None), [[2.0, 1.0, 0.0]])
    near(behaviour_weights(prox, behav, mask, cap=1.5), [[1.5, 1.0, 0.0]])


def test_mismatch_metrics_by_hand():
    # ratios 2 and 1 on the action tokens; the masked third token (ratio e^-3) must not count
    trainer = t([[LOG(0.5), LOG(0.5), 0.0]])
    behav = t([[LOG(0.25), LOG(0.5), 3.0]])
    mask = t([[1, 1, 0]])
    m = {k: v.item() for k, v in mismatch_metrics(trainer, behav, mask, cap=1.5).items()}
    assert m["mismatch/ratio_mean"] == pytest.approx(1.5)
    assert m["mismatch/ratio_max"] == pytest.approx(2.0)
    assert m["mismatch/ratio_min"] == pytest.approx(1.0)
    assert m["mismatch/kl"] == pytest.approx((2.0 - 1.0 - LOG(2.0)) / 2)  # k3: r - 1 - log r
    assert m["mismatch/kl_k1"] == pytest.approx(-LOG(2.0) / 2)
    assert m["mismatch/truncated_frac"] == pytest.approx(0.5)
    assert "mismatch/truncated_frac" not in mismatch_metrics(trainer, behav, mask, cap=None)


def test_value_loss_clipping():
    values = leaf([1.0, 0.6])
    loss, clipped = value_loss(values, t([0.5, 0.5]), t([2.0, 2.0]), clip=0.2)
    loss.sum().backward()
    # first: clipped value 0.7 is further from the return -> 0.5 * 1.3^2, no gradient
    # second: inside the clip range -> 0.5 * 1.4^2, gradient V - R = -1.4
    assert loss.tolist() == pytest.approx([0.5 * 1.69, 0.5 * 1.96])
    assert values.grad.tolist() == pytest.approx([0.0, -1.4])
    assert clipped.tolist() == [True, False]
