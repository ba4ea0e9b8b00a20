"""LoRA adapters folded into full weights, `W + scale * B A`, shared by the trainer (the merged
weights it sends explorers) and `tandem eval` (an adapter-only checkpoint, evaluated merged);
and adapters as they are (`weights.lora_transfer: adapter`): the names of a peft adapter folder,
which vLLM's LoRA API loads as one version.

The merge works from a peft model's state dict by name, so it is the same on one process, under
DDP and under FSDP2 (whose gathered state dict has the same names). Loading an adapter folder
needs `peft`; the merge itself is plain tensor arithmetic.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from torch import Tensor

ADAPTER = "default"  # peft's name for the one adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a peft adapter folder's files
ADAPTER_CONFIG = "adapter_config.json"


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter entries of a peft model's state dict under the names peft saves them with
    (`base_model.model.<layer>.lora_A.weight`: the adapter's name dropped), which
    `PeftModel.from_pretrained` and vLLM's LoRA loader read."""
    return {name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(
        f".lora_B.{ADAPTER}.", ".lora_B."): tensor.detach()
        for name, tensor in state.items() if ".lora_A." in name or ".lora_B." in name}


def adapter_config_json(peft_config: Any) -> bytes:
    """A peft `LoraConfig` as the `adapter_config.json` its `save_pretrained` writes (sets as
    sorted lists), for inference."""
    config = dict(peft_config.to_dict(), inference_mode=True)
    return json.dumps(config, indent=2, sort_keys=True,
                      default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)
                      ).encode()


def merged_state(state: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """Hugging Face names -> weights with the adapters folded in, from a peft model's state
    dict (`base_model.model.` prefixed, `.base_layer.` and `.lora_A/B.default.` entries);
    `scale` is alpha / r (alpha / sqrt(r) with rsLoRA)."""
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


def adapter_scale(adapter: str | Path) -> float:
    """alpha / r of a peft adapter folder (`adapter_config.json`)."""
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def merge_adapter(base: str | Path, adapter: str | Path) -> Any:
    """The Hugging Face model at `base` with the peft adapter folder `adapter` merged in: a
    plain `transformers` model (no peft wrapper), in the base folder's dtype, on CPU."""
    from peft import PeftModel

    from .vision import load_model

    model = load_model(base, dtype="auto", local_files_only=True)  # a VLM too
    peft_model = PeftModel.from_pretrained(model, str(adapter))
    merged = merged_state(peft_model.state_dict(), adapter_scale(adapter))
    plain = peft_model.unload()  # the base model with its adapter layers removed
    plain.load_state_dict(merged, strict=True)
    return plain
