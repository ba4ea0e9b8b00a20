"""LoRA (`model.lora`): adapters train, the base stays frozen, checkpoints hold the adapters only
and load with plain peft, explorers get base + (alpha / r) B A."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.config import RunConfig
from tandem.common.errors import ConfigError
from tandem.trainer import Trainer
from tandem.trainer.learner import Learner

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def lora_config(model_path, run_dir=None, lora=None, **trainer) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"path": str(model_path), "lora": lora or LORA},
        "run_dir": str(run_dir) if run_dir else "runs/test",
        "trainer": {"micro_batch_tokens": 64, "lr": 2e-2, "tensorboard": False, **trainer},
    })


def response_logprob(learner, experiences):
    from tandem.trainer.batch import build_batch

    batch = build_batch(experiences, learner.pad_id)
    with torch.no_grad():
        out = learner.actor(batch.tokens, batch.attention)
    return ((out.logprobs * batch.mask).sum(-1) / batch.mask.sum(-1)).tolist()


def test_lora_learns_with_the_base_frozen_and_only_adapters_in_the_optimiser(
        tiny_model_path, make_group, with_model_logprobs):
    batch = with_model_logprobs(
        make_group("t1", "1+1=", ["2", "35", "7", "48"], [1.0, 0.0, 0.0, 1.0])
        + make_group("t2", "2*3=", ["6", "9", "ab", "cd"], [1.0, 0.0, 1.0, 0.0]))
    learner = Learner(lora_config(tiny_model_path, aggregation="seq_mean_token_mean"))
    trainable = {n for n, p in learner.actor.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in learner.actor.named_parameters()
              if not p.requires_grad}
    before = response_logprob(learner, batch)
    for _ in range(4):
        learner.step(batch)
    after = response_logprob(learner, batch)
    for e, b, a in zip(batch, before, after):
        assert (a > b) == (e.reward > 0), (e.tokens, b, a)
    for name, p in learner.actor.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    optimised = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert len(optimised) == len(trainable) == len(learner.optimizer.state)


def test_adapter_checkpoint_loads_with_peft_and_merged_weights_are_base_plus_ba(
        tiny_model_path, fixed_batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = Learner(lora_config(tiny_model_path))
    for _ in range(2):
        learner.step(fixed_batch)
    path = learner.save_checkpoint(tmp_path)
    assert not (path / "model").exists()
    adapter = load_file(str(path / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert json.loads((path / "adapter" / "adapter_config.json").read_text())["r"] == 4

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    loaded = PeftModel.from_pretrained(base, str(path / "adapter")).eval()
    tokens = torch.tensor([[3, 17, 42, 9, 5]])
    with torch.no_grad():
        theirs = loaded(input_ids=tokens).logits
        ours = learner.actor.model.eval()(input_ids=tokens).logits
    assert torch.allclose(theirs, ours, atol=1e-6)

    merged = learner.policy_state_dict()
    assert set(merged) == set(base_state)
    scale = LORA["alpha"] / LORA["r"]
    changed = 0
    for name, w in base_state.items():
        layer = name.removesuffix(".weight")
        a_key = f"base_model.model.{layer}.lora_A.weight"
        if a_key in adapter:
            b = adapter[f"base_model.model.{layer}.lora_B.weight"]
            expected = w + scale * b @ adapter[a_key]
            changed += 1
        else:
            expected = w
        assert torch.allclose(merged[name], expected, atol=1e-6, rtol=1e-5), name
    assert changed == 2 * 3  # two layers x (q_proj, v_proj, up_proj)
    # and peft's own merge agrees
    folded = loaded.merge_and_unload().state_dict()
    for name, tensor in folded.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


def test_trainer_resumes_from_its_newest_adapter_checkpoint_exactly(
        tiny_model_path, fixed_batch, make_group, tmp_path):
    other = make_group("t3", "9-4=", ["5", "4", "55", "3"], [1.0, 0.0, 1.0, 0.0])
    cfg = lora_config(tiny_model_path, run_dir=tmp_path / "run", warmup_steps=1)
    straight = Learner(cfg)
    for b in (fixed_batch, other, fixed_batch):
        straight.step(b)

    first = Trainer(cfg)
    first.train_step(fixed_batch)
    first.train_step(other)
    first.save_checkpoint()
    resumed = Trainer(cfg)  # from the newest checkpoint in run_dir, as a restarted trainer does
    assert resumed.resumed_from.name == "step_00000002" and resumed.step == 2
    resumed.train_step(fixed_batch)
    expected, got = straight.policy_state_dict(), resumed.learner.policy_state_dict()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_a_target_module_the_model_lacks_is_a_config_error_naming_the_key(tiny_model_path):
    with pytest.raises(ValueError, match=r"model.lora.target_modules: \['qkv_proj'\] not in"):
        lora_config(tiny_model_path, lora={"target_modules": ["q_proj", "qkv_proj"]})
    # present in the weights but not a linear layer: the trainer refuses it when it loads
    cfg = lora_config(tiny_model_path, lora={"target_modules": ["embed_tokens"]})
    with pytest.raises(ConfigError, match="model.lora.target_modules: .*not linear layers"):
        Learner(cfg)

