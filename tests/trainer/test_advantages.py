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


# An all-equal group carries no signal; in float32 its rounding noise became a same-signed
# advantage of ~0.1 on every row (16 rewards of 0.7 gave 0.1061).
EQUAL = [0.1, 0.3, 0.7, 1 / 3, 0.2 + 0.1, 1e-8, 12345.678]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("value", EQUAL)
def test_an_all_equal_group_gets_exactly_zero(name, value):
    rewards = torch.full((16,), value, dtype=torch.float32)
    mask = torch.ones(16, 3)
    out = ADVANTAGES.get(name)(AdvantageInputs(rewards, torch.zeros(16, dtype=torch.long), mask),
                               TrainerConfig())
    assert out.advantages.dtype == torch.float32
    assert torch.equal(out.advantages, torch.zeros(16, 3))


def test_sixteen_rewards_of_0_7_next_to_an_informative_group():
    rewards = torch.tensor([0.7] * 16 + [0.0, 1.0], dtype=torch.float32)
    groups = torch.tensor([0] * 16 + [1, 1])
    out = ADVANTAGES.get("grpo")(AdvantageInputs(rewards, groups, torch.ones(18, 2)),
                                 TrainerConfig())
    assert out.advantages[:16].abs().max().item() == 0.0
    assert out.advantages[16:, 0].tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-3)


@pytest.mark.parametrize("name", ["reinforce_pp", "gae"])
def test_whitening_an_all_equal_batch_gives_zero(name):
    rewards = torch.full((8,), 0.7)
    mask = torch.tensor([[0.0, 1.0, 1.0]] * 8)
    values = torch.zeros(8, 3)  # gae: with gamma=lam=1 every advantage equals the reward
    out = ADVANTAGES.get(name)(AdvantageInputs(rewards, torch.zeros(8, dtype=torch.long), mask,
                                               values=values),
                               TrainerConfig(gamma=1.0, lam=1.0))
    assert torch.equal(out.advantages, torch.zeros(8, 3))


def _reference(name, rewards, groups, eps):
    """Group estimators in float64 with Python floats, one group at a time."""
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        n = len(members)
        mean = math.fsum(members) / n
        if name == "dr_grpo":
            out.append(r - mean)
        elif name == "rloo":
            out.append((r - mean) * n / (n - 1) if n > 1 else 0.0)
        else:
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in members) / max(n - 1, 1))
            out.append((r - mean) / (std + eps))
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_random_groups_match_a_float64_reference(name):
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        groups = torch.randint(0, 6, (48,), generator=gen).sort().values
        rewards = torch.rand(48, generator=gen).float()
        if trial % 2:  # binary rewards, the usual case, with many tied groups
            rewards = (rewards > 0.5).float()
        out = ADVANTAGES.get(name)(AdvantageInputs(rewards, groups, torch.ones(48, 1)),
                                   TrainerConfig())
        want = _reference(name, rewards.double().tolist(), groups.tolist(), 1e-6)
        got = out.advantages[:, 0].double()
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6)
