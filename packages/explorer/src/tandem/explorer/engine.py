"""The inference engine interface every explorer rolls out through.

An engine turns prompts into completions with the log-probability of every sampled token under
the sampling policy (see `tandem.explorer.sampling`). How it takes new weights is its type:
`TensorEngine` (an iterable of (name, tensor), whichever way they travelled) or
`WorkerFetchEngine` (its workers load a checkpoint or join the broadcast themselves).
`tandem.explorer.engines.create_engine` builds the one a config names.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
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
    # the version that sampled each token, from an engine whose weights may change under a
    # generation (interruptible); None: every token at the engine's version
    token_versions: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


class Engine(ABC):
    """Generates completions; `version` is the policy version of the weights it samples with.

    New weights reach an engine one of two ways, and every engine is exactly one of them:
    a `TensorEngine` takes (name, tensor) pairs that this process received, a `WorkerFetchEngine`
    has its own worker processes fetch them. The `WeightLoader` picks the way by that type.
    """

    version: int = 0

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

    async def generate_each(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams,
                            on_prompt: Callable[[int, list[Completion]], Any]
                            ) -> list[list[Completion]]:
        """`generate`, calling `on_prompt(i, completions)` on the event loop as soon as prompt
        `i`'s `n` completions are done, while the others still generate (streaming rollouts).

        This default sends one request per prompt at once, for engines that batch concurrent
        requests themselves (vLLM); an engine with its own batch overrides it.
        """
        async def one(i: int, prompt: Prompt) -> list[Completion]:
            [completions] = await self.generate([prompt], n, sampling)
            on_prompt(i, completions)
            return completions

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    def close(self) -> None:
        """Release the model and any worker thread."""


class TensorEngine(Engine):
    """An engine that holds its model in this process and takes weights as tensors."""

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


class WorkerFetchEngine(Engine):
    """An engine whose worker processes fetch new weights themselves (vLLM's workers):
    tensors never pass through the explorer's process."""

    @abstractmethod
    async def fetch_checkpoint(self, run_dir: str, version: int) -> int:
        """Workers load `run_dir/weights/v{version}`; returns tensors loaded per worker."""

    @abstractmethod
    async def join_group(self, rendezvous: dict[str, Any], explorer: str, timeout: float) -> None:
        """Workers join the trainer's broadcast group (a `GroupRendezvous` as a plain map: it
        crosses into the worker processes)."""

    @abstractmethod
    async def fetch_broadcast(self, version: int) -> int:
        """Workers receive `version` from the trainer's broadcast; returns tensors loaded."""
