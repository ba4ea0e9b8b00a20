"""The inference engine interface every explorer rolls out through.

An engine turns prompts into completions with the log-probability of every sampled token under
the sampling policy (see `tandem.explorer.sampling`), and takes new weights as an iterable of
(name, tensor), whichever way they travelled (checkpoint files or a broadcast).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
import asyncio
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from .sampling import SamplingParams

FinishReason = Literal["eos", "stop", "length"]
Prompt = str | Sequence[int]


@dataclass
class Completion:
    """One sampled response to one prompt.

    `token_ids` and `logprobs` are aligned: `logprobs[i]` is the log-probability of
    `token_ids[i]` under the sampling policy. A response that ended on a stop string keeps the
    tokens of the stop string, and `text` is the decoded `token_ids` (stop string included);
    `stop` names the stop string that ended it. An `eos` ending keeps the eos token too.
    """

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    text: str
    finish_reason: FinishReason
    stop: str | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


class Engine(ABC):
    """Generates completions and takes new weights; `version` is the weights' policy version."""

    version: int = 0
    #: True when the engine's own worker processes fetch new weights (vLLM): the WeightLoader
    #: then calls `fetch_checkpoint` or `join_group` + `fetch_broadcast` instead of streaming
    #: tensors through this process into `load_weights`.
    workers_fetch_weights: bool = False

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer that matches the model."""

    @abstractmethod
    async def generate(self, prompts: Sequence[Prompt], n: int,
                       sampling: SamplingParams) -> list[list[Completion]]:
        """`n` completions per prompt (text, or token ids), one list per prompt, in order.

        Runs off the event loop, so the caller's heartbeats and subscriptions keep going.
        """

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]], version: int) -> int:
        """Copy (name, tensor) pairs into the model and set `version`; returns tensors loaded."""

    async def update_weights(self, source: Callable[[], Iterable[tuple[str, Any]]],
                             version: int) -> int:
        """`load_weights(source(), version)` off the event loop, never during a generation.

        `source` is called where the tensors are consumed, so a blocking producer (a broadcast
        receiver waiting for its next bucket) runs off the loop too.
        """
        return await asyncio.to_thread(lambda: self.load_weights(source(), version))

    async def fetch_checkpoint(self, run_dir: str, version: int) -> int:
        """Workers load `run_dir/weights/v{version}` themselves (`workers_fetch_weights`)."""
        raise NotImplementedError

    async def join_group(self, rendezvous: dict[str, Any], explorer: str, timeout: float) -> None:
        """Workers join the trainer's broadcast group (`workers_fetch_weights`)."""
        raise NotImplementedError

    async def fetch_broadcast(self, version: int) -> int:
        """Workers receive `version` from the trainer's broadcast (`workers_fetch_weights`)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the model and any worker thread."""


def create_engine(config, model_config) -> Engine:
    """The engine an `explorers[i].engine` section asks for, loading `model.path` from disk."""
    if config.kind == "transformers":
        from .transformers_engine import TransformersEngine

        return TransformersEngine.from_pretrained(
            model_config.path, device=config.device, dtype=model_config.dtype,
            max_batch=config.max_batch, **config.options)
    if config.kind == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(model_config.path, dtype=model_config.dtype,
                                          **config.options)
    raise ValueError(f"engine.kind {config.kind!r}: expected transformers or vllm")
