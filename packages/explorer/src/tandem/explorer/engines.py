"""The engines an explorer can run, by `explorers[i].engine.kind`: the one place that names them.

Apart from `engine.py` (the interfaces) so that an engine module imports its interface and
nothing imports back: each engine loads only when asked for, with its heavy dependencies.
"""

from __future__ import annotations

from tandem.common.config import EngineConfig, ModelConfig

from .engine import Engine


def create_engine(config: EngineConfig, model_config: ModelConfig, *,
                  lora_adapters: bool = False) -> Engine:
    """The engine an `explorers[i].engine` section asks for, loading `model.path` from disk
    (for `remote`, its tokenizer; the server at `engine.url` holds the model).
    `lora_adapters` (weights.lora_transfer: adapter): vLLM starts with LoRA of model.lora.r."""
    if config.kind == "transformers":
        from .transformers_engine import TransformersEngine

        return TransformersEngine.from_pretrained(
            model_config.path, device=config.device, dtype=model_config.dtype,
            max_batch=config.max_batch, **config.options)
    if config.kind == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(
            model_config.path, dtype=model_config.dtype, max_batch=config.max_batch,
            tensor_parallel_size=config.tensor_parallel_size,
            lora_rank=model_config.lora.r if lora_adapters and model_config.lora else None,
            **config.options)
    if config.kind == "remote":
        from .remote_engine import RemoteEngine

        # model.path still names the model: tandem tokenizes with its tokenizer
        return RemoteEngine.connect(
            config.url, model_config.path, api_key=config.api_key,
            served_model=config.served_model, timeout=config.request_timeout,
            max_concurrency=config.max_concurrency, reload=config.reload,
            seed=int(config.options.get("seed", 0)))
    raise ValueError(f"engine.kind {config.kind!r}: expected transformers, vllm or remote")
