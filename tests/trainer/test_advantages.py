"""Advantage estimators and the dynamic-sampling filter on hand-computed inputs."""

import math

import pytest
import torch

from tandem.common.config import TrainerConfig
from tandem.common.errors import ConfigError
from tandem.trainer.algorithms import ADVANTAGES, AdvantageInputs, informative_rows

REWARDS = torch.tensor([1.0, 0.0, 0.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 1])
MASK = torch.tensor([[1.0, 1.0, 0.0]] * 4)


def near(actual, expected):
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.detach().double(), expected)


def seq_adv(name, **cfg):
    out = ADVANTAGES.get(name)(AdvantageInputs(REWARDS, GROUPS, MASK), TrainerConfig(**cfg))
    assert (out.advantages[:, 2] == 0).all()  # nothing off the mask
    assert torch.equal(out.advantages[:, 0], out.advantages[:, 1])
    return out.advantages[:, 0].tolist()


def test_grpo_scales_by_unbiased_group_std_and_a_single_gets_zero():
    std = math.sqrt(1 / 3)
    expected = [2 / 3 / std, -1 / 3 / std, -1 / 3 / std, 0.0]
    assert seq_adv("grpo", std_eps=1e-12) == pytest.approx(expected)


def test_dr_grpo_does_not_scale():
    assert seq_adv("dr_grpo") == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0])


def test_rloo_leaves_one_out():
    assert seq_adv("rloo") == pytest.approx([1.0, -0.5, -0.5, 0.0])


def test_token_rewards_add_to_the_sequence_reward():
    token_rewards = torch.tensor(
        [[0.0, 0.0, 9.0], [0.5, 0.5, 9.0], [0.0, 0.0, 9.0], [0.0, 0.0, 0.0]])
    out = ADVANTAGES.get("dr_grpo")(AdvantageInputs(REWARDS, GROUPS, MASK, token_rewards),
                                    TrainerConfig())
    # sequence rewards become 1, 1, 0 (masked 9s ignored) -> mean 2/3
    assert out.advantages[:, 0].tolist() == pytest.approx([1 / 3, 1 / 3, -2 / 3, 0.0])


def test_reinforce_pp_whitens_returns_over_the_batch():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    out = ADVANTAGES.get("reinforce_pp")(
        AdvantageInputs(torch.tensor([1.0, 3.0]), torch.tensor([0, 1]), mask),
        TrainerConfig(std_eps=1e-12))
    # returns 1,1 and 3,3 -> mean 2, unbiased std sqrt(4/3)
    z = 1 / math.sqrt(4 / 3)
    near(out.advantages, [[-z, -z, 0.0], [0.0, z, z]])


def test_gae_returns_skip_non_action_tokens():
    values = torch.tensor([[0.5, 9.0, 0.2]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    inp = AdvantageInputs(torch.tensor([1.0]), torch.tensor([0]), mask, values=values)
    out = ADVANTAGES.get("gae")(inp, TrainerConfig(gamma=1.0, lam=1.0, std_eps=1e-12))
    # delta_2 = 1 - 0.2 = 0.8; delta_0 = 0.2 - 0.5 = -0.3; A_0 = -0.3 + 0.8 = 0.5
    near(out.returns, [[1.0, 0.0, 1.0]])
    near(out.advantages, [[-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)]])
    out = ADVANTAGES.get("gae")(inp, TrainerConfig(gamma=1.0, lam=0.5))
    near(out.returns, [[0.5 + (-0.3 + 0.4), 0.0, 1.0]])


def test_gae_needs_values():
    with pytest.raises(ValueError, match="value"):
        ADVANTAGES.get("gae")(AdvantageInputs(REWARDS, GROUPS, MASK), TrainerConfig())


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="trainer.advantage.*grpo"):
        ADVANTAGES.get("nope")


def test_dynamic_sampling_drops_groups_with_equal_rewards():
    keep, dropped = informative_rows(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0]),
                                     torch.tensor([0, 0, 1, 1, 2, 2, 3]))
    assert keep.tolist() == [False, False, True, True, False, False, False]
    assert dropped == 3  # a group of one has no spread either
