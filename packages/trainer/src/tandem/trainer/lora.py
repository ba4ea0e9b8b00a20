"""LoRA through `peft`: adapters on the policy, and the merged weights explorers load.

With `model.lora` the policy is a `peft` model whose base weights are frozen: the optimiser sees
only the adapters, and checkpoints hold only them (`checkpoints/step_N/adapter`, which plain
`PeftModel.from_pretrained(base, path)` loads). Explorers get full weights with the adapters
folded in, `W + (alpha / r) B A`, computed from a state dict by name, so it works the same on one
process, under DDP and under FSDP2 (whose gathered state dict has the same names).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor, nn

from tandem.common.config import LoraConfig
from tandem.common.errors import ConfigError

ADAPTER = "default"  # peft's name for the one adapter


def _check_targets(model: nn.Module, lora: LoraConfig, where: str) -> None:
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
              if isinstance(m, nn.Linear)}
    missing = [t for t in lora.target_modules if t not in linear]
    if missing:
        raise ConfigError([f"model.lora.target_modules: {missing} are not linear layers of the "
                           f"model at {where} (its linear layers: {', '.join(sorted(linear))})"])


def add_adapters(model: nn.Module, lora: LoraConfig, where: str,
                 resume_from: Path | None = None) -> nn.Module:
    """The policy with fresh adapters, or with those of a checkpoint's `adapter/` folder."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import PeftModel, get_peft_model
    except ImportError:
        raise ConfigError(["model.lora: LoRA needs peft; pip install 'tandem-trainer[lora]'"]
                          ) from None

    _check_targets(model, lora, where)
    if resume_from is not None:
        return PeftModel.from_pretrained(model, str(resume_from), is_trainable=True)
    return get_peft_model(model, PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), bias="none"))


def merged_state(state: dict[str, Tensor], lora: LoraConfig) -> dict[str, Tensor]:
    """Hugging Face names -> weights with the adapters folded in, from a peft model's state
    dict (`base_model.model.` prefixed, `.base_layer.` and `.lora_A/B.default.` entries)."""
    scale = lora.alpha / lora.r
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        layer = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if layer is not None and name.endswith(".base_layer.weight"):
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"]
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"]
            tensor = tensor.detach() + (b.detach().float() @ a.detach().float()).to(
                tensor.dtype) * scale
        out[hf] = tensor
    return out
