"""Shared fixtures: one tiny Qwen2 per session and experiences built from its tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.common.config import RunConfig
from tandem.common.messages.experience import Experience, experience_id, group_id

sys.path.insert(0, str(Path(__file__).parent))  # the tests import this folder's helpers


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_dir):
    """The suite's tiny Qwen2 (tests/conftest.py builds it once per session)."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def _make_config(model_path, run_dir=None, **trainer) -> RunConfig:
    trainer = {"micro_batch_tokens": 64, "lr": 1e-3, "tensorboard": False, **trainer}
    return RunConfig.model_validate({
        "model": {"path": str(model_path)},
        "run_dir": str(run_dir) if run_dir else "runs/test",
        "trainer": trainer,
    })


def _make_group(tokenizer, task: str, prompt: str, responses: list[str], rewards: list[float],
               version: int = 0, logprob: float = -3.0) -> list[Experience]:
    """One group: responses to `prompt`, with constant behaviour logprobs."""
    p = tokenizer(prompt)["input_ids"]
    out = []
    for i, (text, reward) in enumerate(zip(responses, rewards)):
        r = tokenizer(text)["input_ids"]
        out.append(Experience(
            id=experience_id(task, i, version, "test"), task_id=task,
            group_id=group_id(task, version), tokens=np.array(p + r, dtype=np.int32),
            prompt_len=len(p), action_mask=np.ones(len(r), dtype=np.uint8),
            logprobs=np.full(len(r), logprob, dtype=np.float32), reward=reward,
            policy_version=version))
    return out


@pytest.fixture
def fixed_batch(tokenizer) -> list[Experience]:
    """Two groups of four with mixed rewards: a GRPO step has signal in both."""
    return (_make_group(tokenizer, "t1", "1+1=", ["2", "3", "22", "11"], [1.0, 0.0, 0.0, 1.0])
            + _make_group(tokenizer, "t2", "2*3=", ["6", "5", "66", "six"], [1.0, 0.0, 1.0, 0.0]))


def _with_model_logprobs(experiences: list[Experience], model_path) -> list[Experience]:
    """Behaviour logprobs as the model at `model_path` gives them (an on-policy batch)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.trainer.forward import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for e in experiences:
            tokens = torch.from_numpy(e.tokens.astype(np.int64))[None]
            logp, _ = token_logprobs(model(input_ids=tokens).logits[:, :-1], tokens[:, 1:])
            out.append(e.model_copy(update={"logprobs": logp[0, e.prompt_len - 1:].numpy()}))
    return out


@pytest.fixture
def make_config():
    """make_config(model_path, run_dir=None, **trainer_section) -> RunConfig"""
    return _make_config


@pytest.fixture
def make_group(tokenizer):
    """make_group(task, prompt, responses, rewards, version=0, logprob=-3.0) -> experiences"""
    return lambda *a, **kw: _make_group(tokenizer, *a, **kw)


@pytest.fixture
def with_model_logprobs(tiny_model_path):
    """with_model_logprobs(experiences) -> copies carrying the tiny model's own logprobs"""
    return lambda experiences: _with_model_logprobs(experiences, tiny_model_path)
