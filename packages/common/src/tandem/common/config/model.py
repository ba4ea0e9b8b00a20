"""The `model` section: the Hugging Face model folder every component loads from disk."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class LoraConfig(Section):
    """Low-rank adapters (LoRA, through `peft`): the trainer trains only the adapters of the
    `target_modules` linear layers; its optimiser state and checkpoints hold only them."""

    r: int = Field(default=16, ge=1, description="adapter rank")
    alpha: float = Field(default=32.0, gt=0, description="scaling numerator: delta = alpha/r BA")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="linear layers to adapt, by their name in the model (the last part of the "
                    "module path: q_proj, gate_proj, ...)")


def weight_names(folder: Path) -> list[str] | None:
    """Tensor names in a Hugging Face folder's safetensors files, read from their JSON headers
    (no torch); None when the folder holds no safetensors."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    names: list[str] = []
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names.extend(k for k in json.loads(f.read(size)) if k != "__metadata__")
    return names


class ModelConfig(Section):
    """The policy model: a local Hugging Face folder (config, weights, tokenizer); never a hub."""

    path: str = Field(default="", description="folder with config.json, weights and tokenizer")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="weights dtype for inference and for published weights")
    lora: LoraConfig | None = Field(
        default=None, description="train LoRA adapters instead of every weight; null = full")

    @model_validator(mode="after")
    def _lora_targets_exist(self) -> ModelConfig:
        if self.lora is None or not self.path:
            return self
        names = weight_names(Path(self.path))
        if names is None:
            return self  # not readable here (another host): the trainer checks when it loads
        modules = {n.rsplit(".", 2)[-2] for n in names if n.count(".") >= 2}
        missing = [m for m in self.lora.target_modules if m not in modules]
        if missing:
            raise ValueError(
                f"model.lora.target_modules: {missing} not in the model at {self.path} "
                f"(its modules with weights: {', '.join(sorted(modules))})")
        return self
