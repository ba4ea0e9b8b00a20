"""`weights.lora_transfer: adapter`: the trainer publishes each version as a peft adapter folder
(adapter_config.json + adapter_model.safetensors, checked by its manifest) that plain peft loads,
far smaller than merged full weights; the config refuses what cannot load it, naming the key.
vLLM loading it through its LoRA API is in tests/explorer/test_vllm_lora.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.config import RunConfig
from tandem.trainer import Trainer
from tandem.weights import WeightSubscriber

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}
VLLM = [{"name": "explorer-0", "engine": {"kind": "vllm"}}]


def adapter_config(model_path, run_dir="runs/test", transfer="adapter", lora=LORA,
                   explorers=VLLM, **sections) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"path": str(model_path), "lora": lora}, "run_dir": str(run_dir),
        "trainer": {"micro_batch_tokens": 64, "lr": 2e-2, "tensorboard": False},
        "weights": {"lora_transfer": transfer}, "explorers": explorers, **sections})


def test_adapter_versions_load_with_plain_peft_and_are_smaller_than_merged(
        tiny_model_path, fixed_batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = Trainer(adapter_config(tiny_model_path, tmp_path / "run"))
    trainer.train_step(fixed_batch)
    folder = trainer._publish_checkpoint(1)
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    manifest = WeightSubscriber(tmp_path / "run").check(1)  # sizes and checksums hold
    adapter = load_file(str(folder / "adapter_model.safetensors"))
    assert {t.name for t in manifest.tensors} == set(adapter)
    assert len(adapter) == 2 * 3 * 2  # two layers x three targets x (A, B)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in adapter)
    assert any(t.abs().max() > 0 for k, t in adapter.items() if ".lora_B." in k)  # trained
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == sorted(LORA["target_modules"])

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(folder)).eval()
    tokens = torch.tensor([[3, 17, 42, 9, 5, 11]])
    with torch.no_grad():
        theirs = loaded(input_ids=tokens).logits
        ours = trainer.learner.actor.model.eval()(input_ids=tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(
            str(tiny_model_path), dtype=torch.float32)(input_ids=tokens).logits
    assert torch.allclose(theirs, ours, atol=1e-6)
    assert not torch.allclose(theirs, plain, atol=1e-3)  # the adapter does change the model

    merged = Trainer(adapter_config(tiny_model_path, tmp_path / "merged", transfer="merged"))
    full = merged._publish_checkpoint(1)
    adapter_bytes = sum(f.stat().st_size for f in folder.iterdir())
    merged_bytes = sum(f.stat().st_size for f in full.iterdir())
    print(f"bytes per sync: adapter {adapter_bytes}, merged {merged_bytes}")
    assert adapter_bytes * 5 < merged_bytes


@pytest.mark.parametrize("change, key", [
    ({"lora": None}, "model.lora is not set"),
    ({"explorers": [{"name": "explorer-0"}]}, r"explorers\[explorer-0\].engine.kind: transformers"),
    ({"sync": {"method": "nccl"}}, "sync.method: nccl"),
    ({"weights": {"lora_transfer": "adapter", "transport": "fetch"}}, "weights.transport: fetch"),
], ids=["no-lora", "transformers-engine", "broadcast", "fetch-transport"])
def test_what_cannot_load_adapters_is_a_one_line_error_naming_the_key(tiny_model_path, change,
                                                                      key):
    with pytest.raises(ValueError, match=key) as caught:
        adapter_config(tiny_model_path, **change)
    message = str(caught.value).splitlines()
    assert any("weights.lora_transfer: adapter" in line for line in message)
    adapter_config(tiny_model_path, transfer="merged", **{  # merged takes every engine
        k: v for k, v in change.items() if k != "weights"})
