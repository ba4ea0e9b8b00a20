"""LoRA (`model.lora`) on two gloo ranks under torchrun, DDP and FSDP2: only the adapters train,
they are the same on every rank, the optimiser holds them alone, the published weights are
base + (alpha / r) B A, and all of it matches one process on the same batch."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.config import RunConfig
from tandem.trainer.learner import Learner

from batch_json import write_batch
from test_distributed import torchrun  # bounded, reaps every rank

pytest.importorskip("peft")

WORKER = os.path.join(os.path.dirname(__file__), "lora_dist_worker.py")
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.slow
def test_two_lora_ranks_train_the_adapters_alike_and_match_one(
        tiny_model_path, fixed_batch, tmp_path):
    torchrun(WORKER, tiny_model_path, write_batch(fixed_batch, tmp_path), tmp_path)

    single = Learner(RunConfig.model_validate({
        "model": {"path": str(tiny_model_path), "lora": LORA}, "run_dir": str(tmp_path / "one"),
        "trainer": {"micro_batch_tokens": 24, "lr": 2e-2, "tensorboard": False,
                    "off_policy": {"proximal": True}},
    }))
    base = {k: v.clone() for k, v in single.policy_state_dict().items()}  # before any step
    expected = [single.step(fixed_batch) for _ in range(2)]
    adapters = {n: p.detach().clone() for n, p in single.actor.named_parameters()
                if p.requires_grad}
    assert adapters and all(is_adapter(n) for n in adapters)
    merged = single.policy_state_dict()
    scale = LORA["alpha"] / LORA["r"]
    for mode in ("ddp", "fsdp"):
        ranks = [torch.load(tmp_path / f"{mode}-rank{r}.pt", weights_only=True) for r in (0, 1)]
        for held in ranks:  # adapters only, trained as one process trains them, on every rank
            assert set(held) == set(adapters), mode
            for name, tensor in held.items():
                torch.testing.assert_close(tensor, adapters[name], rtol=1e-4, atol=1e-5)
        for name in adapters:
            assert torch.equal(ranks[0][name], ranks[1][name]), (mode, name)
        for r in (0, 1):
            optimised = json.loads((tmp_path / f"{mode}-rank{r}.json").read_text())["optimised"]
            assert sorted(optimised) == sorted(adapters), (mode, r)

        # published: full weights, base + (alpha / r) B A from the adapters in the checkpoint
        published = torch.load(tmp_path / f"{mode}.pt", weights_only=True)
        saved = load_file(str(tmp_path / mode / "checkpoints" / "step_00000002" / "adapter" /
                              "adapter_model.safetensors"))
        assert not (tmp_path / mode / "checkpoints" / "step_00000002" / "model").exists()
        changed = 0
        for name, tensor in published.items():
            layer = name.removesuffix(".weight")
            a_key = f"base_model.model.{layer}.lora_A.weight"
            want = base[name]
            if a_key in saved:
                want = want + scale * saved[f"base_model.model.{layer}.lora_B.weight"] @ saved[a_key]
                changed += 1
            torch.testing.assert_close(tensor, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(tensor, merged[name], rtol=1e-4, atol=1e-5)
        assert changed == 2 * 3, mode  # two layers x (q_proj, v_proj, up_proj)
        assert set(published) == set(base) - {"lm_head.weight"}  # tied: published once
        metrics = json.loads((tmp_path / f"{mode}.json").read_text())["metrics"]
        for key in ("loss/policy", "optim/grad_norm", "policy/clip_frac"):
            assert metrics[1][key] == pytest.approx(expected[1][key], rel=1e-3, abs=1e-6), \
                (mode, key)
