"""Factories of tandem's own engines, registered by `tandem.explorer.builtins` under
`explorers[i].engine.kind` (`transformers`, `vllm`, `remote`) with their capabilities.

An engine factory is `factory(engine_config, model_config, *, lora_adapters) -> Engine`; a
plugin registers its own the same way (docs/extending.md). Each factory imports its engine
module only when called, with its heavy dependencies.
"""

from __future__ import annotations

from tandem.common.config import EngineConfig, ModelConfig
from tandem.common.plugins import ENGINES, load_installed

from .engine import Engine


def create_engine(config: EngineConfig, model_config: ModelConfig, *,
                  lora_adapters: bool = False) -> Engine:
    """The engine an `explorers[i].engine` section asks for, loading `model.path` from disk
    (for `remote`, its tokenizer; the server at `engine.url` holds the model).
    `lora_adapters` (weights.lora_transfer: adapter): the engine loads LoRA adapter versions."""
    load_installed()
    factory = ENGINES.get(config.kind, "engine.kind")
    return factory(config, model_config, lora_adapters=lora_adapters)


def transformers(config: EngineConfig, model_config: ModelConfig, *,
                 lora_adapters: bool = False) -> Engine:
    from .transformers_engine import TransformersEngine

    return TransformersEngine.from_pretrained(
        model_config.path, device=config.device, dtype=model_config.dtype,
        max_batch=config.max_batch, **config.options)


def vllm(config: EngineConfig, model_config: ModelConfig, *,
         lora_adapters: bool = False) -> Engine:
    from .vllm_engine import VLLMEngine

    return VLLMEngine.from_pretrained(
        model_config.path, dtype=model_config.dtype, max_batch=config.max_batch,
        tensor_parallel_size=config.tensor_parallel_size,
        lora_rank=model_config.lora.r if lora_adapters and model_config.lora else None,
        **config.options)


def remote(config: EngineConfig, model_config: ModelConfig, *,
           lora_adapters: bool = False) -> Engine:
    from .remote_engine import RemoteEngine

    # model.path still names the model: tandem tokenizes with its tokenizer
    return RemoteEngine.connect(
        config.url, model_config.path, api_key=config.api_key,
        served_model=config.served_model, timeout=config.request_timeout,
        max_concurrency=config.max_concurrency, reload=config.reload,
        seed=int(config.options.get("seed", 0)))
