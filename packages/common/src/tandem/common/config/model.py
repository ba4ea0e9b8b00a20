"""The `model` section: the Hugging Face model folder every component loads from disk."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class ModelConfig(Section):
    """The policy model: a local Hugging Face folder (config, weights, tokenizer); never a hub."""

    path: str = Field(default="", description="folder with config.json, weights and tokenizer")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="weights dtype for inference and for published weights")
