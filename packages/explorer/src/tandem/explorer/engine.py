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
from typing import Any, Literal
from collections.abc import Awaitable, Callable, Iterable, Sequence

import numpy as np

from .sampling import SamplingParams

FinishReason = Literal["eos", "stop", "length"]


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt that shows images (docs/vision.md): token ids holding one image placeholder per
    image, where the chat template put each image content part, and the images' normalised PNG
    bytes in that order, named by their content hashes. An engine that takes images widens
    each placeholder to its image's tokens; a completion's `prompt_ids` are the widened ids.
    `messages`: the chat the ids were rendered from, each image a `{"type": "image"}` part,
    for an engine whose server renders the chat itself (`RemoteEngine`)."""

    ids: Sequence[int]
    images: Sequence[bytes]
    hashes: Sequence[str]
    messages: Sequence[dict[str, Any]] | None = None


Prompt = str | Sequence[int] | ImagePrompt
# `on_tokens(row, token_ids, logprobs, top_logprobs)`: a row's newly sampled tokens, on the loop
TokenSink = Callable[[int, list[int], list[float], list[list[tuple[int, float]]] | None], Any]


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
    # per token, the `sampling.top_logprobs` most likely (token id, logprob) under the sampling
    # policy, most likely first; None when not asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt], n: int, *,
                   max_model_len: int | None = None,
                   too_long: Callable[[int, int], Exception] | None = None) -> list[list[int]]:
    """The token ids of each prompt of a call for `n` samples of each: text is tokenized, ids
    are taken as given. ValueError for `n` < 1 or an empty prompt; a prompt that leaves no room
    to generate under `max_model_len` raises `too_long(index, length)` (the engine's own error,
    naming the key that raises the limit), else a ValueError."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    encoded = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, ImagePrompt):
            raise ValueError(f"prompt {index} shows images and this engine takes text only "
                             "(engines that take images: docs/vision.md)")
        ids = (tokenizer(prompt).input_ids if isinstance(prompt, str)
               else [int(t) for t in prompt])
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if max_model_len is not None and len(ids) >= max_model_len:
            if too_long is not None:
                raise too_long(index, len(ids))
            raise ValueError(f"prompt {index} has {len(ids)} tokens, max_model_len is "
                             f"{max_model_len}")
        encoded.append(ids)
    return encoded


async def in_requests(prompts: list[list[int]], n: int, sampling: SamplingParams,
                      request: Callable[[int, list[int], int, int], Awaitable[list[Completion]]]
                      ) -> list[list[Completion]]:
    """`n` completions of each prompt, one list per prompt in order, from concurrent calls of
    `request(index, ids, part, samples)`, each returning `samples` completions of prompt
    `index`: one request (part 0) of `n` samples, except that a greedy call is `n` requests
    (parts 0..n-1) of one sample each, since vLLM refuses n > 1 for greedy sampling."""
    samples = 1 if sampling.greedy else n
    parts = n // samples
    done = await asyncio.gather(*(request(index, ids, part, samples)
                                  for index, ids in enumerate(prompts) for part in range(parts)))
    return [[c for part in done[i * parts:(i + 1) * parts] for c in part]
            for i in range(len(prompts))]


class Engine(ABC):
    """Generates completions; `version` is the policy version of the weights it samples with.

    New weights reach an engine one of two ways, and every engine is exactly one of them:
    a `TensorEngine` takes (name, tensor) pairs that this process received, a `WorkerFetchEngine`
    has its own worker processes fetch them. The `WeightLoader` picks the way by that type.
    """

    version: int = 0

    @property
    def takes_images(self) -> bool:
        """Whether prompts may show images (`ImagePrompt`): the model has a vision tower and
        this engine feeds it (docs/vision.md)."""
        return False

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

    async def generate_stream(self, prompts: Sequence[Prompt], sampling: SamplingParams,
                              on_tokens: TokenSink) -> list[Completion]:
        """One completion per prompt, calling `on_tokens(i, ids, logprobs, top)` on the event
        loop with each batch of tokens prompt `i` gets as they are sampled (the OpenAI
        endpoint's streaming). This default calls it once per prompt when the call is done, for
        an engine that cannot do better; the transformers and vLLM engines override it.
        """
        out = await self.generate(prompts, 1, sampling)
        for i, [c] in enumerate(out):
            on_tokens(i, c.token_ids.tolist(), c.logprobs.tolist(), c.top_logprobs)
        return [c for [c] in out]

    async def sleep(self) -> dict[str, Any]:
        """Release the weights and KV cache until `wake` (an engine that declares `sleep`,
        placement.colocate); returns trace attributes."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    async def wake(self) -> dict[str, Any]:
        """Take memory for the weights again; the next load fills it before any generation."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

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
