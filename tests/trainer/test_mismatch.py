"""The trainer/engine mismatch, measured every step: KL(engine || trainer) of the sampled
tokens, the importance ratio's mean and max, the share above the truncated-IS cap.

Batches are sampled by a real engine on a tiny model. With the transformers engine (the
trainer's own forward) the metrics read no mismatch; behaviour logprobs shifted by a known
amount move them to the values computed by hand, so a broken metric fails. The vLLM test
(`-m vllm`) bounds the mismatch of vLLM's CPU kernels on the same kind of model.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from tandem.common.messages.experience import Experience, experience_id, group_id
from tandem.explorer.sampling import SamplingParams
from tandem.trainer.learner import Learner

TEMPERATURE = 0.7
PROMPTS = ["1+1=", "2*3=", "7-5=", "The quick brown fox"]
SHIFT = 0.1  # subtracted from the behaviour logprobs of every other sequence
CAP = 1.05   # between 1 and exp(SHIFT) = 1.105: exactly the shifted tokens exceed it


def sample(engine) -> list[Experience]:
    groups = engine.generate_sync(PROMPTS, n=4, sampling=SamplingParams(
        temperature=TEMPERATURE, max_tokens=8, seed=0))
    out = []
    for g, completions in enumerate(groups):
        for i, c in enumerate(completions):
            out.append(Experience(
                id=experience_id(f"t{g}", i, 0, "x"), task_id=f"t{g}",
                group_id=group_id(f"t{g}", 0),
                tokens=np.concatenate([c.prompt_ids, c.token_ids]).astype(np.int32),
                prompt_len=len(c.prompt_ids), action_mask=np.ones(len(c), dtype=np.uint8),
                logprobs=c.logprobs.astype(np.float32), reward=float(i % 2), policy_version=0))
    return out


@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    from tandem.explorer.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(tiny_model_dir)
    try:
        return sample(engine)
    finally:
        engine.close()


def assert_no_mismatch(m: dict[str, float], kl: float, ratio: float) -> None:
    assert 0 <= m["mismatch/kl"] < kl, m
    assert abs(m["mismatch/kl_k1"]) < math.sqrt(kl), m
    for name in ("ratio_mean", "ratio_max", "ratio_min"):
        assert abs(m[f"mismatch/{name}"] - 1) < ratio, (name, m)


def test_transformers_engine_shows_no_mismatch_before_the_update(
        tiny_model_path, make_config, sampled):
    # two PPO epochs at a high learning rate: the second update's ratio leaves 1, the
    # mismatch (measured on the step's first forward, before any update) must not
    learner = Learner(make_config(tiny_model_path, temperature=TEMPERATURE, ppo_epochs=2,
                                  lr=5e-2))
    m = learner.step(sampled)
    print({k: v for k, v in m.items() if k.startswith("mismatch/")})  # docs/explorer.md
    assert_no_mismatch(m, kl=1e-4, ratio=1e-3)
    assert "mismatch/truncated_frac" not in m  # no cap, nothing truncated
    assert "mismatch/kl/last" not in m  # measured once per step, not per update
    assert abs(m["policy/ratio_max/last"] - 1) > 1e-2, m


@pytest.mark.parametrize("off_policy", [
    {},  # measured on the first update's forward
    {"proximal": True, "behaviour_weight": True, "is_cap": CAP},  # on the proximal pre-pass
], ids=["first_forward", "proximal_with_cap"])
def test_shifted_behaviour_logprobs_move_the_metrics_to_their_values(
        tiny_model_path, make_config, sampled, off_policy):
    shifted = [e.model_copy(update={"logprobs": e.logprobs - SHIFT}) if i % 2 else e
               for i, e in enumerate(sampled)]
    tokens = sum(len(e.logprobs) for e in sampled)
    share = sum(len(e.logprobs) for e in shifted[1::2]) / tokens
    learner = Learner(make_config(tiny_model_path, temperature=TEMPERATURE,
                                  off_policy=off_policy))
    m = learner.step(shifted)
    r = math.exp(SHIFT)
    assert m["mismatch/ratio_max"] == pytest.approx(r, rel=1e-3)
    assert m["mismatch/ratio_min"] == pytest.approx(1.0, abs=1e-3)
    assert m["mismatch/ratio_mean"] == pytest.approx(1 + share * (r - 1), rel=1e-3)
    assert m["mismatch/kl"] == pytest.approx(share * (r - 1 - SHIFT), rel=2e-2)
    assert m["mismatch/kl_k1"] == pytest.approx(-share * SHIFT, rel=2e-2)
    if off_policy:
        assert m["mismatch/truncated_frac"] == pytest.approx(share)
    else:
        assert "mismatch/truncated_frac" not in m


def test_trainer_step_puts_the_mismatch_in_tensorboard_and_the_trace(
        tmp_path, tiny_model_path, make_config, sampled):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tandem.trainer.trainer import Trainer

    shifted = [e.model_copy(update={"logprobs": e.logprobs - SHIFT}) for e in sampled]
    trainer = Trainer(make_config(tiny_model_path, tmp_path / "run", temperature=TEMPERATURE,
                                  tensorboard=True), resume=False)
    try:
        m = trainer.train_step(shifted)
    finally:
        asyncio.run(trainer.close())
    assert m["mismatch/ratio_mean"] == pytest.approx(math.exp(SHIFT), rel=1e-3)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    for name in ("mismatch/kl", "mismatch/kl_k1", "mismatch/ratio_mean", "mismatch/ratio_max"):
        [scalar] = events.Scalars(name)
        assert (scalar.step, scalar.value) == (1, pytest.approx(m[name], rel=1e-5)), name
    spans = [json.loads(line) for line in
             (tmp_path / "run" / "trace" / "trainer.jsonl").read_text().splitlines()]
    [train] = [s for s in spans if s["kind"] == "train"]
    assert train["attrs"]["mismatch_kl"] == pytest.approx(m["mismatch/kl"], rel=1e-5)
    assert train["attrs"]["mismatch_ratio_max"] == pytest.approx(math.exp(SHIFT), rel=1e-3)


@pytest.fixture(scope="module")
def vllm_sampled(tmp_path_factory):
    """A tiny Qwen2 vLLM's CPU backend can run (its attention needs head_dim >= 32) and a batch
    vLLM sampled from it. Module-scoped: vLLM's multiprocessing resource tracker outlives the
    engine, and must be there before the test's check for leftover processes starts."""
    pytest.importorskip("vllm")
    from tandem.explorer.vllm_engine import VLLMEngine
    from tandem.weights.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("mismatch-model")
    build_tiny_model(path, hidden=128, heads=2, kv_heads=1)
    engine = VLLMEngine.from_pretrained(path, dtype="float32", max_model_len=128,
                                        enforce_eager=True, kv_cache_memory_bytes=128 << 20,
                                        max_batch=16)
    try:
        return path, sample(engine)
    finally:
        engine.close()


@pytest.mark.vllm
def test_vllm_engine_mismatch_is_bounded(vllm_sampled, make_config):
    path, experiences = vllm_sampled
    m = Learner(make_config(path, temperature=TEMPERATURE)).step(experiences)
    print({k: v for k, v in m.items() if k.startswith("mismatch/")})  # docs/explorer.md
    assert_no_mismatch(m, kl=1e-2, ratio=0.1)
