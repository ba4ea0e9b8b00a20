"""The corrections, cispo_clip, length shaping and the sampler's truncation inside real trainer
steps on the tiny model: one micro-batch or several, one process or two gloo ranks, the same
update; and the mismatch a top-p sampler leaves without `trainer.sampler_truncation`."""


import numpy as np
import pytest
import torch

from tandem.trainer.learner import Learner

from ddp_check import assert_two_ranks_match_one
from grads import assert_same_gradient, step_with_grads


# every built-in correction at once, bands wide enough that some tokens stay in each
ALL = [{"name": "truncated_is", "cap": 1.5}, {"name": "masked_is", "lo": 0.4, "hi": 2.5},
       {"name": "seq_is", "cap": 2.0}, {"name": "seq_masked_is", "lo": 0.3, "hi": 3.0},
       {"name": "icepop", "lo": 0.4, "hi": 3.0}, {"name": "m2po", "bound": 0.1}]
TRAINER = {"off_policy": {"proximal": True}, "corrections": ALL, "max_grad_norm": 1e9,
           "length": {"overlong_buffer": 2, "penalty": 0.05, "filter_truncated": True,
                      "max_tokens": 4}}


def off_policy(experiences):
    """The model's own logprobs shifted by a fixed pattern: ratios spread around 1, a few
    outside every band; the second row of each group cut at its cap."""
    out = []
    for i, e in enumerate(experiences):
        shift = 0.6 * np.sin(np.arange(len(e.logprobs)) + i + 0.5).astype(np.float32)
        info = {"finish_reason": "length" if i % 4 == 1 else "stop"}
        out.append(e.model_copy(update={"logprobs": e.logprobs + shift, "info": info}))
    return out


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo_clip"])
def test_corrections_give_the_same_update_in_one_micro_batch_or_several(
        tiny_model_path, fixed_batch, make_config, with_model_logprobs, loss):
    batch = off_policy(with_model_logprobs(fixed_batch))
    results = []
    for budget in (10_000, 16):
        learner = Learner(make_config(tiny_model_path, micro_batch_tokens=budget, loss=loss,
                                      **TRAINER))
        results.append(step_with_grads(learner, batch))
    (m1, p1), (m2, p2) = results
    assert m1["batch/micro_batches"] == 1 and m2["batch/micro_batches"] > 1
    for name in ALL:
        share = m1[f"correction/{name['name']}/masked_frac"]
        assert share == m2[f"correction/{name['name']}/masked_frac"]
    assert 0 < m1["correction/all/masked_frac"] < 1, "the bands mask some tokens, not all"
    assert m1["length/filtered"] == 2.0
    for key in ("loss/policy", "optim/grad_norm", "correction/all/ess"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5), key
    assert_same_gradient(p1, p2)


def test_masking_changes_the_update(tiny_model_path, fixed_batch, make_config,
                                    with_model_logprobs):
    """A correction that masks everything leaves no gradient; one that masks nothing leaves
    the uncorrected step's."""
    batch = off_policy(with_model_logprobs(fixed_batch))
    base = {"off_policy": {"proximal": True}, "max_grad_norm": 1e9}
    plain = Learner(make_config(tiny_model_path, **base)).step(batch)
    wide = Learner(make_config(tiny_model_path, corrections=[
        {"name": "masked_is", "lo": 0.0, "hi": 1e9}], **base)).step(batch)
    shut = Learner(make_config(tiny_model_path, corrections=[
        {"name": "m2po", "bound": 1e-12}], **base)).step(batch)
    assert wide["optim/grad_norm"] == pytest.approx(plain["optim/grad_norm"], rel=1e-6)
    assert shut["optim/grad_norm"] < 1e-3 * plain["optim/grad_norm"]


def top_p_sampled(experiences, model_path, top_p):
    """Behaviour logprobs as a top-p sampler gives them (tandem.explorer.sampling), recorded
    with the experience as the explorer records them."""
    sampling = pytest.importorskip("tandem.explorer.sampling")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    params = sampling.SamplingParams(top_p=top_p)
    out = []
    with torch.no_grad():
        for e in experiences:
            tokens = torch.from_numpy(e.tokens.astype(np.int64))[None]
            logp = sampling.policy_logprobs(model(input_ids=tokens).logits[0, :-1], params)
            picked = logp.gather(-1, tokens[0, 1:, None])[:, 0][e.prompt_len - 1:]
            out.append(e.model_copy(update={"logprobs": picked.numpy(),
                                            "info": {"sampling": params.describe()}}))
    return out


def test_sampler_truncation_removes_the_top_p_mismatch(tiny_model_path, make_config, tokenizer):
    from transformers import AutoModelForCausalLM

    from tandem.common.messages.experience import Experience, group_id

    # responses of the model's own argmax tokens: inside any top-p support
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    prompt = tokenizer("12+34=")["input_ids"]
    rows = []
    for k in range(4):
        tokens = list(prompt) + [k + 5]
        with torch.no_grad():
            for _ in range(5):
                logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
        rows.append(Experience(id=f"e{k}", task_id="t", group_id=group_id("t", 0),
                               tokens=np.array(tokens, dtype=np.int32), prompt_len=len(prompt),
                               action_mask=np.ones(len(tokens) - len(prompt), dtype=np.uint8),
                               logprobs=np.zeros(len(tokens) - len(prompt), dtype=np.float32),
                               reward=float(k % 2), policy_version=0))
    batch = top_p_sampled(rows, tiny_model_path, 0.9)
    kl = {}
    for on in (False, True):
        learner = Learner(make_config(tiny_model_path, off_policy={"proximal": True},
                                      sampler_truncation=on))
        kl[on] = learner.step(batch)["mismatch/kl"]
    assert kl[False] > 1e-3, "a top-p sampler's logprobs differ from the full softmax's"
    assert kl[True] < 1e-6, kl


def test_fp32_logits_under_bf16_autocast(tiny_model_path, fixed_batch, make_config):
    seen = {}
    for on in (False, True):
        learner = Learner(make_config(tiny_model_path, precision="bf16", fp32_logits=on))
        head = learner.actor.model.get_output_embeddings()
        hook = head.register_forward_hook(
            lambda m, i, o, on=on: seen.setdefault(on, o.dtype) and None)  # None: o unchanged
        m = learner.step(fixed_batch)
        hook.remove()
        assert np.isfinite(m["loss/policy"])
    assert seen == {False: torch.bfloat16, True: torch.float32}


@pytest.mark.slow
def test_two_ranks_correct_exactly_what_one_process_corrects(
        tiny_model_path, fixed_batch, make_config, with_model_logprobs, tmp_path):
    batch = off_policy(with_model_logprobs(fixed_batch))
    trainer = {**TRAINER, "loss": "cispo_clip", "micro_batch_tokens": 24}
    assert_two_ranks_match_one(tiny_model_path, trainer, batch, make_config, tmp_path,
                               ("loss/policy", "optim/grad_norm", "correction/all/masked_frac",
                                "correction/all/ess", "correction/m2po/masked_frac",
                                "length/filtered"))
