"""PPO epochs and mini-batches: the inner loop of a trainer step, on the tiny model."""

import hashlib

import pytest
import torch

from tandem.common.config import RunConfig
from tandem.common.errors import ConfigError
from tandem.trainer.batch import mini_batch_rows
from tandem.trainer.learner import Learner

# sha256 of the parameters after two steps on `fixed_batch` (micro_batch_tokens 16), as the
# step was before PPO epochs and mini-batches existed (one update per step): one epoch of one
# mini-batch must reproduce them bit for bit. Bits depend on the machine's float kernels (AVX2
# or AVX-512 matmuls, reduction orders) and on the torch and transformers builds, not only on
# tandem's code: the digests first recorded stopped matching on an AVX-512 machine (issue 31).
# So each set is keyed by `numerics_fingerprint()`, a forward and backward of the tiny model that
# runs no tandem code; on a machine without a recorded set the test skips and names its
# fingerprint. This set was recorded on an AVX-512 (Sapphire Rapids) machine, torch 2.13.0+cpu,
# transformers 5.25.0, from the trainer code that matched the first digests (its last change,
# 6fca863, before them), as this test computes them.
BEFORE_EPOCHS = {
    "ppo_clip": {},
    "gae_kl_proximal": {"advantage": "gae", "kl": {"coef": 0.05},
                        "off_policy": {"proximal": True, "behaviour_weight": True}},
}
DIGESTS = {
    "aca7a9564c4a641e": {
        "ppo_clip": "74abc6ec8ea3c3a63105d7f83239ad117df157c718530ee8126017ad61f86c0a",
        "gae_kl_proximal": "68835cea7f21b1875398b0df229bd483c1f4bb99820f3055632917824e95f7c6",
    },
}


def params_sha256(learner) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(learner.actor.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def numerics_fingerprint(model_path) -> str:
    """This machine's float arithmetic as the trainer uses it, without tandem's code: the
    sha256 of the tiny model's gradients on a fixed batch (its matmuls, attention, norms and
    their reductions), and of torch's and transformers' versions."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (4, 9))
    logits = model(input_ids=tokens).logits
    logits.log_softmax(-1).gather(-1, tokens[..., None]).sum().backward()
    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.grad.numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def recorded(tiny_model_path) -> dict:
    fingerprint = numerics_fingerprint(tiny_model_path)
    if fingerprint not in DIGESTS:
        pytest.skip(f"no digests recorded for this machine's numerics (fingerprint "
                    f"{fingerprint}; see DIGESTS)")
    return DIGESTS[fingerprint]


@pytest.mark.parametrize("case", sorted(BEFORE_EPOCHS))
def test_one_epoch_of_one_mini_batch_is_the_step_as_before(case, tiny_model_path, fixed_batch,
                                                           make_config, recorded):
    learner = Learner(make_config(tiny_model_path, micro_batch_tokens=16, ppo_epochs=1,
                                  mini_batches=1, **BEFORE_EPOCHS[case]))
    for _ in range(2):
        metrics = learner.step(fixed_batch)
    assert params_sha256(learner) == recorded[case]
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
