"""Each off-policy correction, the cispo_clip loss, length shaping and the sampler's truncation
against their papers' formulas on hand-computed tensors (issue 28 items 1-3, 6)."""

import math

import pytest
import torch
from pydantic import ValidationError

from tandem.common.config import RunConfig, TrainerConfig
from tandem.common.config.trainer import LengthShapingConfig
from tandem.trainer.algorithms import (
    CORRECTIONS, POLICY_LOSSES, Aggregator, CorrectionInputs, PolicyInputs, apply_corrections)
from tandem.trainer.algorithms.length import length_shaping, overlong
from tandem.trainer.batch import build_batch
from tandem.trainer.forward import Truncation, token_logprobs

LOG = math.log
# two rows, ratios proximal/behaviour; the last token of row 1 is padding (garbage, mask 0)
RATIOS = [[1.5, 0.4, 3.0], [1.0, 2.0, 50.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def inputs() -> CorrectionInputs:
    proximal = torch.tensor([[LOG(r) for r in row] for row in RATIOS], dtype=torch.float64)
    return CorrectionInputs(proximal - 0.7, torch.full_like(proximal, -0.7),
                            torch.tensor(MASK, dtype=torch.float64))


def correct(name, **params):
    entry_params = CORRECTIONS.declares(name)["params"].model_validate(params)
    weights, metrics = apply_corrections([(name, CORRECTIONS.get(name), entry_params)], inputs())
    return weights, metrics


def near(actual, expected):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64))


def test_truncated_is_caps_the_ratio():
    w, m = correct("truncated_is", cap=2.0)
    near(w, [[1.5, 0.4, 2.0], [1.0, 2.0, 0.0]])
    # ESS = (sum w)^2 / (n sum w^2) over the 5 action tokens
    assert m["correction/truncated_is/ess"].item() == pytest.approx(6.9 ** 2 / (5 * 11.41))
    assert m["correction/truncated_is/weight_mean"].item() == pytest.approx(6.9 / 5)
    assert m["correction/truncated_is/weight_max"].item() == pytest.approx(2.0)
    assert m["correction/truncated_is/masked_frac"].item() == 0.0


def test_masked_is_drops_tokens_outside_the_band_with_weight_one_inside():
    w, m = correct("masked_is", lo=0.5, hi=2.0)
    near(w, [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    assert m["correction/masked_is/masked_frac"].item() == pytest.approx(2 / 5)
    assert m["correction/masked_is/ess"].item() == pytest.approx(9 / (5 * 3))  # 3 of 5 left


def test_icepop_keeps_the_ratio_inside_both_tails_and_zero_outside():
    w, m = correct("icepop", lo=0.5, hi=2.0)
    near(w, [[1.5, 0.0, 0.0], [1.0, 2.0, 0.0]])
    assert m["correction/icepop/weight_mean"].item() == pytest.approx(4.5 / 5)
    assert m["correction/icepop/ess"].item() == pytest.approx(4.5 ** 2 / (5 * 7.25))


def test_sequence_level_weights_use_the_geometric_mean_of_the_ratios():
    s0 = (1.5 * 0.4 * 3.0) ** (1 / 3)  # 1.2164; row 1: sqrt(2) = 1.4142, over the cap
    w, _ = correct("seq_is", cap=1.3)
    near(w, [[s0, s0, s0], [1.3, 1.3, 0.0]])
    w, m = correct("seq_masked_is", lo=0.5, hi=1.3)
    near(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert m["correction/seq_masked_is/masked_frac"].item() == pytest.approx(2 / 5)


def test_m2po_masks_the_largest_squared_log_ratios_until_the_second_moment_fits():
    # squared log-ratios: 1.5 -> 0.164, 0.4 -> 0.840, 3.0 -> 1.207, 1.0 -> 0, 2.0 -> 0.480;
    # ascending running means 0, 0.082, 0.215, 0.371, 0.538
    w, m = correct("m2po", bound=0.1)
    near(w, [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert m["correction/m2po/masked_frac"].item() == pytest.approx(3 / 5)
    w, _ = correct("m2po", bound=0.25)
    near(w, [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    w, _ = correct("m2po", bound=1.0)  # the whole batch fits: nothing masked
    near(w, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_corrections_compose_by_multiplying_in_order():
    band = CORRECTIONS.declares("masked_is")["params"](lo=0.5, hi=2.0)
    cap = CORRECTIONS.declares("truncated_is")["params"](cap=1.2)
    weights, metrics = apply_corrections(
        [("masked_is", CORRECTIONS.get("masked_is"), band),
         ("truncated_is", CORRECTIONS.get("truncated_is"), cap)], inputs())
    near(weights, [[1.2, 0.0, 0.0], [1.0, 1.2, 0.0]])
    assert metrics["correction/all/masked_frac"].item() == pytest.approx(2 / 5)
    assert not weights.requires_grad


def test_cispo_clip_bounds_the_weight_and_keeps_every_tokens_gradient():
    logp = torch.tensor([[LOG(1.5), LOG(0.5), LOG(1.1)], [7.0, 7.0, 7.0]], dtype=torch.float64,
                        requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0], [50.0, 50.0, 50.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    inp = PolicyInputs(logp, torch.zeros_like(adv), adv, mask)
    config = TrainerConfig(loss={"name": "cispo_clip", "eps_high": 0.28})
    loss, m = POLICY_LOSSES.get("cispo_clip")(inp, config, Aggregator("token_mean"))
    loss.backward()
    # w = sg(clip(r, -, 1.28)) = [1.28, 0.5, 1.1]; loss_t = -w A logp
    expected = (-1.28 * LOG(1.5) + 0.5 * LOG(0.5) - 1.1 * LOG(1.1)) / 3
    assert loss.item() == pytest.approx(expected)
    # d loss / d logp_t = -w_t A_t / 3: the clipped token (r = 1.5) still has its gradient
    assert logp.grad[0].tolist() == pytest.approx([-1.28 / 3, 0.5 / 3, -1.1 / 3])
    assert logp.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert m["policy/clip_frac"].item() == pytest.approx(1 / 3)
    # with eps_low the weight is bounded below too: r = 0.5 -> 0.8
    low = TrainerConfig(loss={"name": "cispo_clip", "eps_low": 0.2, "eps_high": 0.28})
    inp.logprobs.grad = None
    loss, _ = POLICY_LOSSES.get("cispo_clip")(inp, low, Aggregator("token_mean"))
    assert loss.item() == pytest.approx((-1.28 * LOG(1.5) + 0.8 * LOG(0.5) - 1.1 * LOG(1.1)) / 3)


def test_corrections_config_errors_name_the_key_and_the_fix():
    base = {"model": {"path": "m"}}
    with pytest.raises(ValidationError, match="set trainer.off_policy.proximal: true"):
        RunConfig.model_validate({**base, "trainer": {"corrections": ["masked_is"]}})
    with pytest.raises(ValidationError, match="write the weight as a correction"):
        RunConfig.model_validate({**base, "trainer": {
            "off_policy": {"proximal": True, "behaviour_weight": True},
            "corrections": ["icepop"]}})
    with pytest.raises(ValidationError, match=r"corrections\.0\.low\n.*not a parameter of "
                                              "off-policy correction masked_is"):
        RunConfig.model_validate({**base, "trainer": {
            "off_policy": {"proximal": True}, "corrections": [{"name": "masked_is", "low": 1}]}})
    with pytest.raises(ValidationError, match=r"lo \(1.5\) < 1 < hi"):
        RunConfig.model_validate({**base, "trainer": {
            "off_policy": {"proximal": True}, "corrections": [{"name": "icepop", "lo": 1.5}]}})
    with pytest.raises(ValidationError, match="unknown off-policy correction 'tis'"):
        RunConfig.model_validate({**base, "trainer": {
            "off_policy": {"proximal": True}, "corrections": ["tis"]}})


def test_overlong_shaping_follows_dapo():
    # L_max 10, L_cache 4: 0 up to 6 tokens, then (6 - |y|) / 4, -1 past the cap
    got = overlong(torch.tensor([5.0, 6.0, 8.0, 10.0, 12.0]), 10, 4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert overlong(torch.tensor([10.0, 11.0]), 10, 0).tolist() == [0.0, -1.0]


def test_length_shaping_and_overlong_filtering_of_a_batch(make_group):
    rows = make_group("t", "1+1=", ["2", "22 22 22 22", "2 2"], [1.0, 1.0, 0.0])
    rows[1] = rows[1].model_copy(update={"info": {"finish_reason": "length"}})
    batch = build_batch(rows)
    lengths = batch.mask.sum(-1).tolist()
    cap = int(max(lengths))
    cfg = LengthShapingConfig(overlong_buffer=2, overlong_penalty=0.5, penalty=0.1,
                              filter_truncated=True)
    shaped, metrics = length_shaping(batch, cfg, cap)
    for i, n in enumerate(lengths):
        soft = 0.0 if n <= cap - 2 else ((cap - 2) - n) / 2
        expected = batch.rewards[i].item() + 0.5 * soft - 0.1 * n / cap
        assert shaped.rewards[i].item() == pytest.approx(expected, abs=1e-6)
    assert shaped.mask[1].sum() == 0 and shaped.mask[0].sum() == batch.mask[0].sum()
    assert metrics["length/filtered"] == 1.0
    assert metrics["length/truncated_frac"] == pytest.approx(1 / 3)


def explorer_policy_logprobs(logits, top_k, top_p):
    sampling = pytest.importorskip("tandem.explorer.sampling")
    params = sampling.SamplingParams(top_k=top_k, top_p=top_p)
    return sampling.policy_logprobs(logits, params)


def test_sampler_truncation_gives_the_explorers_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=gen) * 3
    cases = [(0, 0.9), (7, 1.0), (7, 0.8), (0, 1.0)]
    for top_k, top_p in cases:
        full = explorer_policy_logprobs(logits, top_k, top_p)
        # targets inside the sampler's support, as a sampled token is
        targets = full.argmax(-1)
        trunc = Truncation(torch.full((3,), top_k), torch.full((3,), top_p))
        got, _ = token_logprobs(logits, targets, truncation=trunc)
        want = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(got, want)
    # per row: row 0 top-p 0.5, row 1 untruncated, row 2 top-k 3
    targets = logits.argmax(-1)
    trunc = Truncation(torch.tensor([0, 0, 3]), torch.tensor([0.5, 1.0, 1.0]))
    got, _ = token_logprobs(logits, targets, truncation=trunc)
    for row, (k, p) in enumerate([(0, 0.5), (0, 1.0), (3, 1.0)]):
        want = explorer_policy_logprobs(logits[row], k, p).gather(-1, targets[row, :, None])
        torch.testing.assert_close(got[row], want.squeeze(-1))


def test_sampler_truncation_keeps_the_sampled_token_and_a_finite_entropy():
    logits = torch.tensor([[[5.0, 4.0, 0.0, -1.0]]], requires_grad=True)
    target = torch.tensor([[3]])  # outside top-k 2: the trainer ranks it lower than the sampler
    trunc = Truncation(torch.tensor([2]), torch.tensor([1.0]))
    logp, ent = token_logprobs(logits, target, truncation=trunc, entropy="loss")
    support = torch.tensor([5.0, 4.0, -1.0])
    assert logp.item() == pytest.approx((-1.0 - torch.logsumexp(support, 0)).item())
    assert torch.isfinite(ent).all()
    (logp.sum() + ent.sum()).backward()
    assert logits.grad[0, 0, 2].item() == 0.0 and torch.isfinite(logits.grad).all()
    _, metric = token_logprobs(logits, target, truncation=trunc, entropy="metric")
    torch.testing.assert_close(metric, ent.detach())
