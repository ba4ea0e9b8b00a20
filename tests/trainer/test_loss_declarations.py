"""Policy losses as registered items that declare what they need (`LossNeeds`): the config's
`trainer.loss` section and its parameters, the contract between what a loss declares and what it
is handed, and a user's own loss registered as a plugin would register it."""

import subprocess
import sys

import pytest
import torch
from backstop import BACKSTOP
from pydantic import BaseModel, ConfigDict, Field

from tandem.common.config import RunConfig, TrainerConfig
from tandem.common.config.loader import validate
from tandem.common.errors import ConfigError
from tandem.trainer.algorithms import POLICY_LOSSES, Aggregator, LossNeeds, PolicyInputs
from tandem.trainer.algorithms.masked import masked_mean
from tandem.trainer.learner import Learner

BUILTIN_LOSSES = POLICY_LOSSES.names()  # before any test registers its own


def needs_of(name: str) -> LossNeeds:
    return POLICY_LOSSES.declares(name)["needs"]


def trainer_section(**trainer) -> TrainerConfig:
    return validate(RunConfig, {"trainer": trainer}).trainer


# -- the config section ---------------------------------------------------------------------------

def test_loss_is_a_name_or_a_section_with_its_parameters():
    plain, section = trainer_section(loss="ppo_clip"), trainer_section(loss={"name": "ppo_clip"})
    assert plain.loss == section.loss and plain.loss.params is None
    assert trainer_section(loss="dpo").loss.params.beta == 0.1  # its model's default
    dpo = trainer_section(loss={"name": "dpo", "beta": "0.3"})
    assert dpo.loss.params.beta == 0.3
    assert dpo.model_dump()["loss"] == {"name": "dpo", "beta": "0.3"}
    assert TrainerConfig.model_validate(dpo.model_dump()).loss.params.beta == 0.3
    overridden = validate(RunConfig, {}, ["trainer.loss=dpo", "trainer.groups_per_step=2"])
    assert overridden.trainer.loss.name == "dpo" and overridden.trainer.needs_reference


def test_a_bad_loss_parameter_is_an_error_at_its_key():
    cases = [
        ({"name": "dpo", "betta": 0.2},
         "trainer.loss.betta: not a parameter of policy loss dpo; its parameters: beta"),
        ({"name": "ppo_clip", "beta": 0.2},
         "trainer.loss.beta: policy loss ppo_clip takes no parameters"),
        ({"name": "dpo", "beta": 0}, "trainer.loss.beta: Input should be greater than 0"),
        ("ppo2", "trainer.loss: unknown policy loss 'ppo2'; registered: cispo_clip, dpo, gspo, "
                 "pg, ppo_clip"),
    ]
    for loss, message in cases:
        with pytest.raises(ConfigError) as err:
            validate(RunConfig, {"trainer": {"loss": loss}})
        assert err.value.errors[0].startswith(message), err.value.errors


def test_rules_read_the_declarations():
    assert trainer_section(loss="dpo").needs_reference
    assert not trainer_section(loss="ppo_clip").needs_reference
    assert trainer_section(loss="ppo_clip", kl={"coef": 0.1}).needs_reference
    assert trainer_section(advantage="gae").needs_value_head
    for loss in ("sft", "dpo"):  # both declare advantages=False
        with pytest.raises(ConfigError, match=f"trainer.advantage: gae trains a value head for "
                                              f"advantages, which trainer.loss: {loss} does not"):
            trainer_section(loss=loss, advantage="gae")
        with pytest.raises(ConfigError, match="trainer.kl.placement: reward folds the KL"):
            trainer_section(loss=loss, kl={"coef": 0.1, "placement": "reward"})
    with pytest.raises(ConfigError, match=r"trainer.mini_batches: 3 exceeds the 2 pairs"):
        validate(RunConfig, {"trainer": {"loss": "dpo", "groups_per_step": 2, "mini_batches": 3}})


def test_the_declarations_load_without_torch():
    """The master and `tandem up` check configs with the trainer's declarations: the entry
    point's module must not import torch."""
    code = ("import sys\n"
            "from tandem.common.plugins import POLICY_LOSSES, ADVANTAGES, load_installed\n"
            "load_installed()\n"
            "assert POLICY_LOSSES.declares('dpo')['needs'].pairs, POLICY_LOSSES\n"
            "assert ADVANTAGES.declares('gae')['value_head'], ADVANTAGES\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=BACKSTOP)


# -- the contract: a loss gets what it declares, and works on exactly that ------------------------

@pytest.mark.parametrize("name", BUILTIN_LOSSES)
def test_every_loss_trains_on_exactly_what_it_declares(name):
    needs = needs_of(name)
    rows = 4 if needs.pairs else 3  # a pairs loss gets (chosen, rejected) pairs; others any count
    gen = torch.Generator().manual_seed(0)
    logp = (-0.1 - torch.rand(rows, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    mask = torch.ones(rows, 5, dtype=torch.float64)
    mask[:, -1] = 0  # padding: no gradient may reach it
    noise = 0.1 * torch.rand(rows, 5, generator=gen, dtype=torch.float64)
    inp = PolicyInputs(
        logprobs=logp, old_logprobs=logp.detach() - noise,
        advantages=torch.randn(rows, 5, generator=gen, dtype=torch.float64)
        if needs.advantages else None,
        mask=mask,
        ref_logprobs=logp.detach() + noise if needs.reference else None,
        values=torch.zeros(rows, 5, dtype=torch.float64) if needs.value_head else None)
    agg = Aggregator("token_mean", total_tokens=float(mask.sum()), total_seqs=float(rows))
    loss, metrics = POLICY_LOSSES.get(name)(inp, trainer_section(loss=name), agg)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert logp.grad[:, :-1].abs().sum() > 0
    assert (logp.grad[:, -1] == 0).all()


@pytest.mark.parametrize("name", BUILTIN_LOSSES)
def test_the_learner_hands_each_loss_what_it_declares(name, tiny_model_path, fixed_batch,
                                                       make_config):
    needs = needs_of(name)
    # a reference (for the KL term) and, where advantages are used, a value head (for gae)
    # exist either way: the loss sees each only if it declared it
    learner = Learner(make_config(tiny_model_path, loss=name, kl={"coef": 0.05},
                                  advantage="gae" if needs.advantages else "grpo"))
    assert learner.reference is not None
    seen = []
    loss_fn = learner.loss_fn

    def spy(inp, cfg, agg):
        seen.append(inp)
        return loss_fn(inp, cfg, agg)

    learner.loss_fn = spy
    m = learner.step(fixed_batch)
    assert seen and "kl/reference" in m
    for inp in seen:
        assert (inp.ref_logprobs is not None) == needs.reference
        assert (inp.advantages is not None) == needs.advantages
        assert (inp.values is not None) == needs.value_head
    # fixed_batch: two groups of four, each with a best and a worst response
    assert sum(inp.mask.shape[0] for inp in seen) == (4 if needs.pairs else 8)
    assert ("pairs/dropped_groups" in m) == needs.pairs


# -- a user's own loss, registered as a plugin registers it ---------------------------------------

class AnchorParams(BaseModel):
    """The user loss's parameters, declared by the loss itself."""

    model_config = ConfigDict(extra="forbid")
    coef: float = Field(gt=0)


def anchored_sft(inp, cfg, agg):
    """Cross-entropy of the action tokens held near the reference: -logp + coef (logp - ref)^2."""
    drift = (inp.logprobs - inp.ref_logprobs) ** 2
    token_loss = -inp.logprobs + cfg.loss.params.coef * drift
    return agg(token_loss, inp.mask), {"anchored/drift": masked_mean(drift.detach(), inp.mask)}


@pytest.fixture
def anchored_loss():
    POLICY_LOSSES.register("anchored_sft", anchored_sft, needs=LossNeeds(
        reference=True, advantages=False, params=AnchorParams))
    yield "anchored_sft"
    POLICY_LOSSES.unregister("anchored_sft")


def test_a_user_loss_with_a_reference_and_parameters_trains_a_step(
        anchored_loss, tiny_model_path, fixed_batch, make_config):
    config = make_config(tiny_model_path, lr=1e-2, loss={"name": anchored_loss, "coef": 0.5})
    assert config.trainer.loss.params == AnchorParams(coef=0.5)
    assert config.trainer.kl.coef == 0 and config.trainer.needs_reference
    learner = Learner(config)
    assert learner.reference is not None  # loaded for the loss's declared need alone
    before = {k: v.detach().clone() for k, v in learner.actor.state_dict().items()}
    first = learner.step(fixed_batch)
    assert first["anchored/drift"] == 0.0  # the policy still equals the reference
    assert "advantage/mean" not in first  # it declared advantages=False: none computed
    assert any(not torch.equal(before[k], v) for k, v in learner.actor.state_dict().items())
    assert learner.step(fixed_batch)["anchored/drift"] > 0.0


def test_a_user_loss_is_checked_by_its_own_declarations(anchored_loss):
    with pytest.raises(ConfigError, match="trainer.loss.coeff: not a parameter of policy loss "
                                          "anchored_sft; its parameters: coef"):
        validate(RunConfig, {"trainer": {"loss": {"name": anchored_loss, "coef": 1, "coeff": 1}}})
    with pytest.raises(ConfigError, match="trainer.loss.coef: Field required"):
        validate(RunConfig, {"trainer": {"loss": anchored_loss}})
    with pytest.raises(ConfigError, match=f"trainer.loss: {anchored_loss} does not use"):
        validate(RunConfig, {"trainer": {"loss": {"name": anchored_loss, "coef": 1},
                                         "kl": {"coef": 0.1, "placement": "reward"}}})
