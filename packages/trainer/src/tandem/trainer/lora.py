"""LoRA through `peft`: adapters on the policy, and the merged weights explorers load.

With `model.lora` the policy is a `peft` model whose base weights are frozen: the optimiser sees
only the adapters, and checkpoints hold only them (`checkpoints/step_N/adapter`, which plain
`PeftModel.from_pretrained(base, path)` loads). Explorers get full weights with the adapters
folded in, `W + (alpha / r) B A`, by `tandem.weights.lora.merged_state` (shared with `tandem eval`,
which evaluates an adapter checkpoint merged the same way).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tandem.common.config import LoraConfig
from tandem.common.errors import ConfigError
from tandem.weights.vision import vision_tower


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
        target_modules=list(lora.target_modules), bias="none",
        # a vision-language model's vision tower is never adapted: LoRA is the language model's
        exclude_modules=r".*\.visual\..*" if vision_tower(model) is not None else None))
