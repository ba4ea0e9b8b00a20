"""On-policy distillation (`trainer.advantage: distill`, `trainer.teacher`): the advantage on a
hand-computed case, the config's rules, and real trainer steps on the tiny model with a teacher
of its own shape: the advantage the learner computes, one micro-batch or several, one process or
two gloo ranks, the same update."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tandem.common.config import RunConfig, TrainerConfig
from tandem.common.errors import ConfigError
from tandem.trainer.algorithms import ADVANTAGES, AdvantageInputs
from tandem.trainer.algorithms.distill import teacher_metrics
from tandem.trainer.learner import Learner

from grads import assert_same_gradient, step_with_grads

from ddp_check import assert_two_ranks_match_one


# two sequences of one group; the third column is off the mask
STUDENT = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.1, -9.0]])
TEACHER = torch.tensor([[-0.5, -3.0, -1.0], [-0.5, -1.1, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
REWARDS, GROUPS = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])


def distill(**teacher):
    cfg = TrainerConfig(advantage="distill", std_eps=1e-12, teacher={"path": "t", **teacher})
    inp = AdvantageInputs(REWARDS, GROUPS, MASK, logprobs=STUDENT, teacher=TEACHER)
    return ADVANTAGES.get("distill")(inp, cfg).advantages.double()


def test_the_advantage_is_teacher_minus_student_per_token():
    expected = [[0.5, -1.0, 0.0], [0.0, -1.0, 0.0]]
    torch.testing.assert_close(distill(), torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(distill(coef=2.0), 2 * torch.tensor(expected, dtype=torch.float64))


def test_the_task_advantage_is_added_by_its_weight():
    # grpo of rewards (1, 0): mean 0.5, unbiased std sqrt(0.5): +-1/sqrt(2) on every action token
    g = 1 / math.sqrt(2)
    expected = [[0.5 + 0.5 * g, -1.0 + 0.5 * g, 0.0], [0.0 - 0.5 * g, -1.0 - 0.5 * g, 0.0]]
    torch.testing.assert_close(distill(task_weight=0.5),
                               torch.tensor(expected, dtype=torch.float64))
    rloo = [[0.5 + 1.0, -1.0 + 1.0, 0.0], [0.0 - 1.0, -1.0 - 1.0, 0.0]]  # n/(n-1)(r - mean) = 1
    torch.testing.assert_close(distill(task_weight=1.0, task_advantage="rloo"),
                               torch.tensor(rloo, dtype=torch.float64))


def test_the_reverse_kl_metric():
    m = teacher_metrics(STUDENT, TEACHER, MASK)
    # student - teacher on the four action tokens: -0.5, 1.0, 0.0, 1.0
    assert m["teacher/reverse_kl"] == pytest.approx(1.5 / 4)
    assert m["teacher/reverse_kl_seq_max"] == pytest.approx(0.5)


def test_distill_needs_a_teacher():
    with pytest.raises(ValidationError, match="trainer.teacher.path"):
        TrainerConfig(advantage="distill")


def test_a_task_advantage_with_a_value_head_is_refused():
    with pytest.raises(ValidationError, match="trainer.teacher.task_advantage: gae"):
        TrainerConfig(advantage="distill", teacher={"path": "t", "task_weight": 1.0,
                                                    "task_advantage": "gae"})
    with pytest.raises(ValidationError, match="trainer.teacher.task_advantage: unknown"):
        TrainerConfig(advantage="distill", teacher={"path": "t", "task_weight": 1.0,
                                                    "task_advantage": "nope"})


def test_a_teacher_elsewhere_is_refused_naming_the_key():
    with pytest.raises(ValidationError, match="trainer.teacher.engine.kind: remote"):
        TrainerConfig(advantage="distill", teacher={
            "path": "t", "engine": {"kind": "remote", "url": "http://h:8000/v1"}})


@pytest.fixture(scope="module")
def teacher_path(tiny_model_path, tmp_path_factory):
    """The tiny model with every weight moved a little: a teacher of the policy's shape and
    tokenizer whose logprobs differ from the policy's."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("teacher")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out))
    for f in tiny_model_path.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".txt"):
            shutil.copy(f, out / f.name)
    return out


def test_a_teacher_with_another_vocabulary_is_a_config_error(tiny_model_path, teacher_path,
                                                            tmp_path):
    from transformers import AutoModelForCausalLM

    other = tmp_path / "wide"
    model = AutoModelForCausalLM.from_pretrained(str(teacher_path), dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model.save_pretrained(str(other))
    config = {"model": {"path": str(tiny_model_path)},
              "trainer": {"advantage": "distill", "teacher": {"path": str(other)}}}
    with pytest.raises(ValidationError, match=r"trainer.teacher.path: the teacher at .* has "
                                              r"vocab_size \d+, the policy at .* \d+"):
        RunConfig.model_validate(config)
    # a tokenizer of other tokens, with the same vocabulary size
    shutil.copytree(teacher_path, tmp_path / "renamed")
    tokenizer = json.loads((tmp_path / "renamed" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "renamed" / "tokenizer.json").write_text(json.dumps(tokenizer))
    config["trainer"]["teacher"]["path"] = str(tmp_path / "renamed")
    with pytest.raises(ValidationError, match="trainer.teacher.path: .* another tokenizer"):
        RunConfig.model_validate(config)


def test_a_missing_teacher_is_named_when_the_trainer_loads(tiny_model_path, make_config,
                                                          tmp_path):
    with pytest.raises(ConfigError, match="trainer.teacher.path: no Hugging Face model folder"):
        Learner(make_config(tiny_model_path, advantage="distill",
                            teacher={"path": str(tmp_path / "absent")}))


def logprobs_of(model, experiences):
    """Each response token's logprob under `model`, computed here apart from the trainer."""
    out = []
    with torch.no_grad():
        for e in experiences:
            tokens = torch.from_numpy(e.tokens.astype(np.int64))[None]
            logp = torch.log_softmax(model(input_ids=tokens).logits[0, :-1].double(), -1)
            out.append(logp.gather(-1, tokens[0, 1:, None])[e.prompt_len - 1:, 0].numpy())
    return out


def teacher_logprobs(experiences, teacher_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(teacher_path), dtype=torch.float32)
    return logprobs_of(model, experiences)


def test_the_learner_advantage_is_the_teachers_logprob_minus_the_samplers(
        tiny_model_path, teacher_path, fixed_batch, make_config, with_model_logprobs):
    batch = with_model_logprobs(fixed_batch)
    learner = Learner(make_config(tiny_model_path, advantage="distill", max_grad_norm=1e9,
                                  teacher={"path": str(teacher_path), "coef": 2.0}))
    m = learner.step(batch)
    diffs = np.concatenate([t - e.logprobs for t, e in
                            zip(teacher_logprobs(batch, teacher_path), batch)])
    assert diffs.std() > 0.05, "the teacher differs from the policy"
    assert m["advantage/mean"] == pytest.approx(2.0 * diffs.mean(), rel=1e-4, abs=1e-6)
    assert m["teacher/reverse_kl"] == pytest.approx(-diffs.mean(), rel=1e-4, abs=1e-6)


def test_distillation_moves_the_student_towards_the_teacher(
        tiny_model_path, teacher_path, fixed_batch, make_config, with_model_logprobs):
    batch = with_model_logprobs(fixed_batch)
    teacher = np.concatenate(teacher_logprobs(batch, teacher_path))
    learner = Learner(make_config(tiny_model_path, advantage="distill", lr=1e-3,
                                  off_policy={"proximal": True},
                                  teacher={"path": str(teacher_path)}))

    def gap():  # how far the student's logprobs of the batch's tokens are from the teacher's
        return float(np.abs(np.concatenate(logprobs_of(learner.actor.model, batch)) - teacher)
                     .mean())

    gaps = [gap()]
    for _ in range(3):
        learner.step(batch)  # the proximal pass anchors each step to the student as it is
        gaps.append(gap())
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 0.7 * gaps[0], gaps


def test_the_teacher_only_measures_under_another_advantage(
        tiny_model_path, teacher_path, fixed_batch, make_config, with_model_logprobs):
    batch = with_model_logprobs(fixed_batch)
    plain = Learner(make_config(tiny_model_path)).step(batch)
    watched = Learner(make_config(tiny_model_path, teacher={"path": str(teacher_path)})).step(batch)
    assert watched["teacher/reverse_kl"] > 0
    for key in ("advantage/mean", "loss/policy", "optim/grad_norm"):
        assert watched[key] == plain[key], key


TRAINER = {"advantage": "distill", "max_grad_norm": 1e9, "micro_batch_tokens": 24}


def test_distill_gives_the_same_update_in_one_micro_batch_or_several(
        tiny_model_path, teacher_path, fixed_batch, make_config, with_model_logprobs):
    batch = with_model_logprobs(fixed_batch)
    teacher = {"path": str(teacher_path), "task_weight": 0.5}
    results = []
    for budget in (10_000, 16):
        learner = Learner(make_config(tiny_model_path, **{
            **TRAINER, "micro_batch_tokens": budget, "teacher": teacher}))
        results.append(step_with_grads(learner, batch))
    (m1, p1), (m2, p2) = results
    assert m1["batch/micro_batches"] == 1 and m2["batch/micro_batches"] > 1
    for key in ("teacher/reverse_kl", "advantage/mean", "loss/policy", "optim/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    assert_same_gradient(p1, p2)


@pytest.mark.slow
def test_two_ranks_distill_exactly_what_one_process_distills(
        tiny_model_path, teacher_path, fixed_batch, make_config, with_model_logprobs, tmp_path):
    batch = with_model_logprobs(fixed_batch)
    trainer = {**TRAINER, "off_policy": {"proximal": True},
               "teacher": {"path": str(teacher_path), "task_weight": 0.5}}
    assert_two_ranks_match_one(tiny_model_path, trainer, batch, make_config, tmp_path,
                               ("teacher/reverse_kl", "teacher/reverse_kl_seq_max",
                                "advantage/mean", "loss/policy", "optim/grad_norm"))
