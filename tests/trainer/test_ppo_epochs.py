"""PPO epochs and mini-batches: the inner loop of a trainer step, on the tiny model."""

import hashlib

import pytest
import torch

from tandem.common.config import RunConfig
from tandem.common.errors import ConfigError
from tandem.trainer.batch import mini_batch_rows
from tandem.trainer.learner import Learner

# sha256 of the parameters after two steps on `fixed_batch` (micro_batch_tokens 16), recorded
# with the step as it was before PPO epochs and mini-batches existed (one update per step),
# torch 2.13.0+cpu. One epoch of one mini-batch must reproduce them bit for bit.
BEFORE_EPOCHS = {
    "ppo_clip": ({}, "3a3dce4e438f5f4e2e59de77246a8b87a482bfaa3be82e6dd16421513338acaf"),
    "gae_kl_proximal": (
        {"advantage": "gae", "kl": {"coef": 0.05},
         "off_policy": {"proximal": True, "behaviour_weight": True}},
        "85bde93e45d61d268feaf8481aa36aff268a7edfc4580297963ae71c67477d19"),
}
RECORDED_WITH = "2.13.0+cpu"


def params_sha256(learner) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(learner.actor.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.skipif(torch.__version__ != RECORDED_WITH,
                    reason=f"digests recorded with torch {RECORDED_WITH}")
@pytest.mark.parametrize("case", sorted(BEFORE_EPOCHS))
def test_one_epoch_of_one_mini_batch_is_the_step_as_before(case, tiny_model_path, fixed_batch,
                                                           make_config):
    extra, digest = BEFORE_EPOCHS[case]
    learner = Learner(make_config(tiny_model_path, micro_batch_tokens=16, ppo_epochs=1,
                                  mini_batches=1, **extra))
    for _ in range(2):
        metrics = learner.step(fixed_batch)
    assert params_sha256(learner) == digest
    assert "train/updates" not in metrics and "policy/clip_frac/last" not in metrics


def test_more_updates_move_the_ratio_off_its_anchor(tiny_model_path, fixed_batch, make_config,
                                                    with_model_logprobs):
    on_policy = with_model_logprobs(fixed_batch)
    single = Learner(make_config(tiny_model_path, lr=1e-2)).step(on_policy)
    assert single["policy/clip_frac"] == 0.0  # ratio 1 everywhere: nothing to clip

    learner = Learner(make_config(tiny_model_path, lr=1e-2, ppo_epochs=2, mini_batches=2))
    m = learner.step(on_policy)
    assert m["train/updates"] == 4.0 and m["batch/mini_batches"] == 2.0
    assert learner.version == 1  # four updates, one trainer step, one weights version
    # the last update clips against the batch's behaviour logprobs, three updates away
    assert m["policy/clip_frac/last"] > 0.0
    assert m["policy/clip_frac"] > single["policy/clip_frac"]
    assert m["policy/clip_frac"] < m["policy/clip_frac/last"]  # the first update clipped nothing
    assert {"loss/policy/last", "optim/grad_norm/last"} <= set(m)


def test_mini_batch_split_is_a_seeded_partition_that_keeps_units_together():
    first = mini_batch_rows(8, 3, unit=2, seed=(0, 5, 1))
    assert first == mini_batch_rows(8, 3, unit=2, seed=(0, 5, 1))  # every rank, same split
    assert sorted(r for part in first for r in part) == list(range(8))
    assert sorted(len(p) for p in first) == [2, 2, 4]
    for part in first:
        assert all(r % 2 == 0 and r + 1 in part for r in part if r % 2 == 0)
    splits = {tuple(map(tuple, mini_batch_rows(8, 2, seed=(0, s, 0)))) for s in range(6)}
    assert len(splits) > 1  # the shuffle changes with the step
    assert mini_batch_rows(5, 1, seed=(9,)) == [[0, 1, 2, 3, 4]]  # one part: no shuffle


def test_more_mini_batches_than_sequences_fails_at_config_load(tiny_model_path):
    with pytest.raises(ValueError, match="trainer.mini_batches: 9 exceeds the 8 sequences"):
        RunConfig.model_validate({
            "model": {"path": str(tiny_model_path)},
            "trainer": {"groups_per_step": 2, "mini_batches": 9},
            "explorers": [{"repeat_times": 4}]})
    with pytest.raises(ValueError, match="trainer.mini_batches: 3 exceeds the 2 pairs"):
        RunConfig.model_validate({"trainer": {"groups_per_step": 2, "mini_batches": 3,
                                              "loss": "dpo"}})


def test_more_mini_batches_than_a_step_has_fails_at_the_step(tiny_model_path, fixed_batch,
                                                             make_config):
    learner = Learner(make_config(tiny_model_path, mini_batches=6))
    with pytest.raises(ConfigError, match="trainer.mini_batches: 6 mini-batches, but step 0 "
                                          "has only 4 sequences"):
        learner.step(fixed_batch[:4])
