"""`weights.lora_transfer: adapter` against real vLLM: the trainer publishes adapter-only versions,
VLLMEngine (LoRA enabled, rank from model.lora.r) loads each with vLLM's LoRA API, and the logprobs
of what it samples are the trainer's teacher-forced logprobs of base + adapter. One engine for the
module: vLLM takes a minute or more to start on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backstop import BACKSTOP
from interrupt_helpers import stream_until_every_sample_has_tokens

from tandem.common.config import RunConfig
from tandem.common.messages.experience import Experience, experience_id, group_id
from tandem.explorer.sampling import SamplingParams, policy_logprobs

pytestmark = pytest.mark.vllm

PROMPTS = ["1+2=", "What is 7*6? ", "The quick brown fox"]
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
TOLERANCE = 2e-3  # float32 on CPU: vLLM's kernels sum in another order than the trainer's forward
LORA = {"r": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from tandem.explorer.engines import create_engine
    from tandem.trainer import Trainer
    from tandem.weights.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("lora-model")
    build_tiny_model(path, hidden=128, heads=2, kv_heads=1)  # vLLM's CPU attention: head_dim 64
    run_dir = tmp_path_factory.mktemp("lora-run")
    config = RunConfig.model_validate({
        "model": {"path": str(path), "lora": LORA, "dtype": "float32"}, "run_dir": str(run_dir),
        "trainer": {"micro_batch_tokens": 256, "lr": 5e-2, "tensorboard": False},
        "weights": {"lora_transfer": "adapter"},
        "explorers": [{"name": "explorer-0", "engine": {"kind": "vllm", "options": {
            "max_model_len": 160, "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}}}]})
    trainer = Trainer(config)
    # as the explorer builds it: LoRA on, rank from model.lora.r
    engine = create_engine(config.explorers[0].engine, config.model, lora_adapters=True)
    assert engine.lora_rank == LORA["r"]
    yield trainer, engine, run_dir
    engine.close()


def experiences(groups, version: int) -> list[Experience]:
    """Sampled completions as a GRPO batch, rewarded by their share of even token ids."""
    out = []
    for g, group in enumerate(groups):
        for i, c in enumerate(group):
            task = f"t{g}"
            tokens = np.concatenate([c.prompt_ids, c.token_ids]).astype(np.int32)
            out.append(Experience(
                id=experience_id(task, i, version, "test"), task_id=task,
                group_id=group_id(task, version), tokens=tokens, prompt_len=len(c.prompt_ids),
                action_mask=np.ones(len(c.token_ids), dtype=np.uint8), logprobs=c.logprobs,
                reward=float(np.mean(c.token_ids % 2 == 0)),
                policy_version=version))
    return out


def worst_gap(model, groups) -> float:
    """Largest |engine - teacher-forced| logprob of any sampled token under `model`."""
    worst = 0.0
    model.eval()
    for group in groups:
        for c in group:
            ids = torch.tensor(np.concatenate([c.prompt_ids, c.token_ids]).astype(np.int64))[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0]
            p = len(c.prompt_ids)
            expected = policy_logprobs(logits[p - 1:-1], PARAMS).gather(
                -1, ids[0, p:, None]).squeeze(-1)
            worst = max(worst, (expected - torch.from_numpy(c.logprobs)).abs().max().item())
    return worst


async def test_each_adapter_version_samples_the_trainers_base_plus_adapter_logprobs(setup):
    from peft import PeftModel

    trainer, engine, run_dir = setup
    policy = trainer.learner.actor.model  # the peft model: base + adapter
    assert engine.version == 0
    groups = await engine.generate(PROMPTS, 4, PARAMS)  # version 0: the base model, no adapter
    with policy.disable_adapter():
        assert worst_gap(policy, groups) < TOLERANCE

    for version in (1, 2):
        trainer.train_step(experiences(groups, version - 1))
        folder = trainer._publish_checkpoint(version)
        assert (folder / "adapter_config.json").is_file()
        assert await engine.fetch_checkpoint(run_dir, version) == 2 * 4 * 2
        assert engine.version == version
        groups = await engine.generate(PROMPTS, 4, PARAMS)
        assert worst_gap(policy, groups) < TOLERANCE
        with policy.disable_adapter():  # and the adapter is what made the difference
            assert worst_gap(policy, groups) > 20 * TOLERANCE
    assert 2 in await engine._loop.run(engine.llm.list_loras())  # vLLM holds the adapter

    # a published version is a plain peft adapter folder (what vLLM loaded)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(trainer.config.model.path),
                                                dtype=torch.float32)
    assert worst_gap(PeftModel.from_pretrained(base, str(folder)), groups) < TOLERANCE


async def test_an_interruptible_engine_switches_adapters_mid_generation(setup):
    """on_new_weights: interrupt with adapters: running samples stop at a token boundary and go
    on under the new adapter, each token at the version that sampled it."""
    import asyncio

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer, engine, run_dir = setup
    before = engine.version
    long = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True, seed=9)
    engine.interruptible = True
    try:
        groups = await engine.generate(PROMPTS, 2, PARAMS)
        trainer.train_step(experiences(groups, before))
        folder = trainer._publish_checkpoint(before + 1)
        generation, sampled = stream_until_every_sample_has_tokens(engine, PROMPTS, 2, long)
        await asyncio.wait_for(sampled.wait(), BACKSTOP)
        await engine.fetch_checkpoint(run_dir, before + 1)
        groups = await asyncio.wait_for(generation, BACKSTOP)
    finally:
        engine.interruptible = False
    base = AutoModelForCausalLM.from_pretrained(str(trainer.config.model.path),
                                                dtype=torch.float32)
    old = PeftModel.from_pretrained(base, str(run_dir / "weights" / f"v{before}")).eval()
    new = trainer.learner.actor.model.eval()
    splits = []
    for c in (c for g in groups for c in g):
        versions = c.token_versions.tolist()
        k = versions.count(before)
        assert len(c) == 128 and versions == [before] * k + [before + 1] * (128 - k)
        splits.append(k)
        for model, part in ((old, slice(0, k)), (new, slice(k, 128))):
            ids = torch.tensor(np.concatenate([c.prompt_ids, c.token_ids]).astype(np.int64))[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0]
            p = len(c.prompt_ids)
            expected = policy_logprobs(logits[p - 1:-1], long).gather(
                -1, ids[0, p:, None]).squeeze(-1).numpy()
            assert np.abs(expected[part] - c.logprobs[part]).max(initial=0) < TOLERANCE
    assert all(0 < k < 128 for k in splits), splits  # every sample, after its first tokens
    assert folder.is_dir() and engine.version == before + 1


async def test_a_full_weights_version_is_refused_naming_the_key(setup, tmp_path):
    from tandem.explorer.vllm_engine import VLLMError
    from tandem.weights import WeightPublisher

    _, engine, _ = setup
    before = engine.version
    WeightPublisher(tmp_path).publish(7, [("model.norm.weight", torch.ones(128))])
    with pytest.raises(VLLMError, match="weights.lora_transfer: adapter: .* no adapter_config"):
        await engine.fetch_checkpoint(tmp_path, 7)
    assert engine.version == before  # still the last adapter
