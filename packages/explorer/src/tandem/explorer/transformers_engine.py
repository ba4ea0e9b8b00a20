"""`TransformersEngine`: batched sampling over a Hugging Face causal LM with a KV cache.

Its own decode loop, rather than `model.generate`, so the log-probability of each sampled token
comes out of the same forward pass under the sampling policy, and rows that finish are dropped
from the batch (and the cache) instead of decoding padding until the longest row ends.
Generation runs on one worker thread: the event loop stays free for heartbeats and barriers, and
weights never change under a running batch because loading runs on the same thread.

An `interruptible` engine takes new weights mid-generation (`explorers[].on_new_weights:
interrupt`): a load waits in a queue that the decode loop checks at every token boundary; the
loop loads the weights there, prefills the partial sequences again under them (their KV cache
belongs to the old weights) and carries on, recording the version that sampled each token.

Asleep (`placement.colocate`, docs/deployment.md): `sleep` releases every parameter's storage
(each becomes a one-element view broadcast to its shape, so names and shapes stay) and hands the
memory back to the allocator; the KV cache lives only within a call, so nothing else is held.
`wake` allocates fresh, uninitialised parameters and refuses to generate until `load_weights`
fills them: the one copy from the shared-memory segment's views into the model is the only
copy this side makes, so no third copy of the model exists while it wakes.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import structlog
import torch

from tandem.weights import model_dtype
from tandem.weights.hf import load_tokenizer
from tandem.weights.vision import (
    ImageInputs, VisionInputs, load_model, restrict, rope_positions, vision_prefix)

from .engine import Completion, ImagePrompt, Prompt, TensorEngine, TokenSink, encode_prompts
from .sampling import SamplingParams, sample_with_top

log = structlog.get_logger(__name__)


class EngineAsleep(RuntimeError):
    """Asked to generate while the engine's weights are released (placement.colocate)."""


class TransformersEngine(TensorEngine):
    """The embedded default engine, on CPU or one CUDA device."""

    def __init__(self, model: Any, tokenizer: Any, *, device: str = "cpu", max_batch: int = 64,
                 version: int = 0, seed: int = 0, interruptible: bool = False,
                 vision: VisionInputs | None = None):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self._tokenizer = tokenizer
        self.max_batch = max_batch
        self.version = version
        self.seed = seed
        self._calls = 0
        self.interruptible = interruptible
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        # re-entrant: an interrupting load runs inside the generation that holds it
        self._lock = threading.RLock()
        self._loads: queue.SimpleQueue[tuple[Callable[[], Iterable], int, Future]] = \
            queue.SimpleQueue()
        self.eos_ids = _eos_ids(model, tokenizer)
        # "awake", "asleep" (storage released) or "woken" (fresh storage, not yet loaded)
        self.state = "awake"
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        # a vision-language model's image processor: prompts may show images (docs/vision.md)
        self.vision = vision
        self._unsampleable = (torch.tensor(vision.unsampleable, device=self.device)
                              if vision is not None else None)
        # a version without the vision tower (trainer.freeze_vision) leaves this one's as is
        self._tower = vision_prefix(model) if vision is not None else None

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "cpu", dtype: str = "float32",
                        max_batch: int = 64, **options: Any) -> TransformersEngine:
        """Load a model folder from disk (config, safetensors, tokenizer); never a hub."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path {str(path)!r} is not a Hugging Face model folder (no config.json)")
        torch_dtype = model_dtype(dtype)
        seed = int(options.pop("seed", 0))
        attn = options.pop("attn_implementation", "sdpa")
        threads = options.pop("threads", None)
        if options:
            raise ValueError(f"engine.options: unknown keys {sorted(options)} for transformers "
                             "(known: seed, attn_implementation, threads)")
        if threads is not None:
            # process-wide: an explorer process runs one engine
            torch.set_num_threads(int(threads))
        tokenizer = load_tokenizer(path)
        model = load_model(path, dtype=torch_dtype, local_files_only=True,
                           attn_implementation=attn)
        return cls(model, tokenizer, device=device, max_batch=max_batch, seed=seed,
                   vision=VisionInputs.of(path, model))

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    async def generate(self, prompts: Sequence[Prompt], n: int,
                       sampling: SamplingParams) -> list[list[Completion]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.generate_sync, prompts, n, sampling)

    async def generate_each(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams,
                            on_prompt: Callable[[int, list[Completion]], Any]
                            ) -> list[list[Completion]]:
        # one batch as `generate` samples it (same tokens for the same seed); a prompt is handed
        # to the loop as soon as its last row leaves the batch
        loop = asyncio.get_running_loop()

        def done(i: int, completions: list[Completion]) -> None:
            loop.call_soon_threadsafe(on_prompt, i, completions)

        return await loop.run_in_executor(
            self._executor, lambda: self.generate_sync(prompts, n, sampling, on_prompt=done))

    async def generate_stream(self, prompts: Sequence[Prompt], sampling: SamplingParams,
                              on_tokens: TokenSink) -> list[Completion]:
        # the decode loop hands each step's tokens to the event loop as one callback, so a
        # step costs the loop one wake-up however many rows stream
        loop = asyncio.get_running_loop()

        def step(batch: list[tuple[int, int, float, list[tuple[int, float]] | None]]) -> None:
            loop.call_soon_threadsafe(_deliver, on_tokens, batch)

        out = await loop.run_in_executor(
            self._executor, lambda: self.generate_sync(prompts, 1, sampling, on_step=step))
        return [c for [c] in out]

    def generate_sync(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams, *,
                      on_prompt: Callable[[int, list[Completion]], None] | None = None,
                      on_step: Callable[[list[tuple[int, int, float, Any]]], None] | None = None
                      ) -> list[list[Completion]]:
        """The blocking body of `generate`, for callers without an event loop; `on_prompt(i,
        completions)` is called (on this thread) as soon as prompt `i`'s rows are all done, and
        `on_step([(row, token, logprob, top), ...])` after each decode step with the token each
        running row got (row: prompt index * n + sample)."""
        if self.state != "awake":
            raise EngineAsleep(f"the transformers engine is {self.state} (placement.colocate): "
                               "its weights are released until a version is loaded")
        prompts, images = self._with_images(prompts)
        encoded = encode_prompts(self._tokenizer, prompts, n)
        rows = [(p, s) for p in range(len(encoded)) for s in range(n)]
        out: list[list[Completion | None]] = [[None] * n for _ in encoded]
        left = [n] * len(encoded)
        generator = self._generator(sampling)
        with self._lock, torch.inference_mode():
            for start in range(0, len(rows), self.max_batch):
                chunk = rows[start:start + self.max_batch]

                def finished(j: int, completion: Completion, chunk=chunk) -> None:
                    p, s = chunk[j]
                    out[p][s] = completion
                    left[p] -= 1
                    if left[p] == 0 and on_prompt is not None:
                        on_prompt(p, out[p])  # type: ignore[arg-type]

                self._take_loads()  # between chunks too: a load never waits for the whole call
                self._generate_chunk([encoded[p] for p, _ in chunk], sampling, generator,
                                     finished, [images[p] for p, _ in chunk],
                                     None if on_step is None else
                                     (lambda batch, start=start: on_step(
                                         [(start + j, *rest) for j, *rest in batch])))
        return out  # type: ignore[return-value]

    def _with_images(self, prompts: Sequence[Prompt]
                     ) -> tuple[list[Prompt], list[tuple[ImageInputs, str] | None]]:
        """Prompts with each image prompt's placeholders widened to its images' tokens, and
        each prompt's image inputs (None: text only) with a key naming its images."""
        out: list[Prompt] = []
        images: list[tuple[ImageInputs, str] | None] = []
        for i, p in enumerate(prompts):
            if not isinstance(p, ImagePrompt):
                if (self.vision is not None and not isinstance(p, str)
                        and self.vision.image_token_id in p):
                    raise ValueError(f"prompt {i} holds image placeholder tokens but no images "
                                     "(an ImagePrompt carries them)")
                out.append(p)
                images.append(None)
                continue
            if self.vision is None:
                raise ValueError(f"prompt {i} shows images but {type(self.model).__name__} "
                                 "has no vision tower (model.path: a vision-language model)")
            inputs = self.vision.process(p.images)
            out.append(self.vision.expand(p.ids, inputs))
            images.append((inputs, " ".join(p.hashes)))
        return out, images

    def _generator(self, sampling: SamplingParams) -> torch.Generator:
        # Each call gets its own stream: reproducible for a given seed, different across calls.
        self._calls += 1
        seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._calls
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def _prefill(self, prompts: list[list[int]],
                 images: list[tuple[ImageInputs, str] | None]
                 ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cache, next-token logits, attention mask, next position, rotary delta) of each
        sequence, left-padded; each distinct sequence (its tokens and images) is prefilled once,
        rows sampling the same one share its cache. With images, positions are the model's
        multimodal ones and a later token's is its text position plus the row's delta."""
        unique: dict[tuple, int] = {}
        row_of = [unique.setdefault((tuple(p), im[1] if im else None), len(unique))
                  for p, im in zip(prompts, images)]
        first = {k: images[row_of.index(i)] for i, k in enumerate(unique)}
        distinct = [k[0] for k in unique]
        shown = [first[k] for k in unique]
        width = max(len(p) for p in distinct)
        ids = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for i, p in enumerate(distinct):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        vision = ImageInputs.cat([s[0] if s else None for s in shown])
        delta = None
        if vision is None:
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                past_key_values=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1]
        else:
            vision = vision.to(self.device)
            rope, delta = rope_positions(self.model, ids, mask, vision)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=rope,
                                pixel_values=vision.pixel_values.to(self.model.dtype),
                                image_grid_thw=vision.grid_thw, past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1]
        select = torch.tensor(row_of, device=self.device)
        if len(distinct) != len(prompts) or row_of != list(range(len(prompts))):
            cache.batch_select_indices(select)
            logits, mask = logits[select], mask[select]
            delta = None if delta is None else delta[select]
        return cache, self._restrict(logits), mask, positions[select, -1] + 1, delta

    def _restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """A vision-language model's logits without its placeholder tokens (never sampled)."""
        return restrict(logits, self._unsampleable)

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams,
                        generator: torch.Generator,
                        finished: Callable[[int, Completion], None],
                        images: list[tuple[ImageInputs, str] | None],
                        on_step: Callable[[list[tuple[int, int, float, Any]]], None] | None
                        ) -> None:
        t0 = time.perf_counter()
        cache, logits, mask, next_pos, delta = self._prefill(prompts, images)
        t_prefill = time.perf_counter()

        stops = _StopMatcher(sampling.stop, self._tokenizer)
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in prompts]

        def complete(row: int, reason: str, stop: str | None = None) -> None:
            now = time.perf_counter()
            finished(row, Completion(
                prompt_ids=np.asarray(prompts[row], dtype=np.int32),
                token_ids=np.asarray(tokens[row], dtype=np.int32),
                logprobs=np.asarray(logps[row], dtype=np.float32),
                text=self._tokenizer.decode(tokens[row], skip_special_tokens=True),
                finish_reason=reason, stop=stop,  # type: ignore[arg-type]
                timings={"prefill_s": t_prefill - t0, "decode_s": now - t_prefill,
                         "generate_s": now - t0, "batch": float(len(prompts))},
                token_versions=(np.asarray(versions[row], dtype=np.int32)
                                if self.interruptible else None),
                top_logprobs=tops[row] if sampling.top_logprobs else None))

        active = list(range(len(prompts)))
        eos_ids = set() if sampling.ignore_eos else self.eos_ids
        for step in range(sampling.max_tokens):
            tok, lp, top = sample_with_top(logits, sampling, generator)
            tok_list, lp_list = tok.tolist(), lp.tolist()
            top_rows = ([list(zip(ids, values)) for values, ids in
                         zip(top[0].tolist(), top[1].tolist())] if top is not None
                        else [None] * len(active))
            if on_step is not None:
                on_step([(row, tok_list[j], lp_list[j], top_rows[j])
                         for j, row in enumerate(active)])
            keep: list[int] = []
            for j, row in enumerate(active):
                tokens[row].append(tok_list[j])
                logps[row].append(lp_list[j])
                versions[row].append(self.version)
                if top is not None:
                    tops[row].append(top_rows[j])
                if tok_list[j] in eos_ids:
                    complete(row, "eos")
                elif (hit := stops.match(tokens[row])) is not None:
                    complete(row, "stop", hit)
                elif step + 1 < sampling.max_tokens:
                    keep.append(j)
                else:
                    complete(row, "length")
            if not keep:
                break
            if self._take_loads():
                # new weights at this token boundary: the cache is the old weights' view of the
                # partial sequences, so they are prefilled again under the new ones
                active = [active[j] for j in keep]
                cache, logits, mask, next_pos, delta = self._prefill(
                    [prompts[r] + tokens[r] for r in active], [images[r] for r in active])
                continue
            if len(keep) != len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                tok, mask, next_pos = tok[index], mask[index], next_pos[index]
                delta = None if delta is None else delta[index]
                active = [active[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            position = next_pos[:, None]
            if delta is not None:  # multimodal rotary positions: each section at text + delta
                position = (position + delta).unsqueeze(0).expand(3, -1, -1)
            logits = self._restrict(self.model(
                input_ids=tok[:, None], attention_mask=mask, position_ids=position,
                past_key_values=cache, use_cache=True).logits[:, -1])
            next_pos = next_pos + 1

    def _take_loads(self) -> bool:
        """Carry out the loads waiting for a token boundary (engine thread); True if any ran."""
        if not self.interruptible:
            return False
        ran = False
        while True:
            try:
                source, version, future = self._loads.get_nowait()
            except queue.Empty:
                return ran
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.load_weights(source(), version))
                ran = True
            except BaseException as exc:  # the caller's await raises it
                future.set_exception(exc)

    def load_weights(self, weights: Iterable[tuple[str, Any]], version: int) -> int:
        with self._lock:
            if self.state == "asleep":
                self.wake_sync()
            loaded = load_named_tensors(self.model, weights, keep=self._tower)
            self.version = version
            self.state = "awake"
        log.info("weights.loaded", version=version, tensors=loaded)
        return loaded

    def _parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())  # tied parameters once

    def sleep_sync(self) -> dict[str, Any]:
        """Release every parameter's storage (between calls: never under a running batch)."""
        with self._lock:
            if self.state == "asleep":
                return {"released_bytes": 0}
            released = 0
            for p in self._parameters():
                released += p.numel() * p.element_size()
                # a single element seen at every index: the shape stays for `wake`, and a
                # write into it fails instead of landing anywhere
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            self.state = "asleep"
        _return_freed_memory(self.device)
        log.info("engine.asleep", version=self.version, released_bytes=released)
        return {"released_bytes": released}

    def wake_sync(self) -> dict[str, Any]:
        """Allocate fresh parameters; `load_weights` must fill them before the next call."""
        with self._lock:
            if self.state != "asleep":
                return {"allocated_bytes": 0}
            allocated = 0
            for p in self._parameters():
                p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                allocated += p.numel() * p.element_size()
            self.state = "woken"
        return {"allocated_bytes": allocated}

    async def sleep(self) -> dict[str, Any]:
        """`sleep_sync` on the engine thread, after the running batch."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.sleep_sync)

    async def wake(self) -> dict[str, Any]:
        """`wake_sync` on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.wake_sync)

    async def update_weights(self, source: Callable[[], Iterable[tuple[str, Any]]],
                             version: int) -> int:
        loop = asyncio.get_running_loop()
        if not self.interruptible:
            # on the engine thread after the running batch: weights never change under it
            return await loop.run_in_executor(
                self._executor, lambda: self.load_weights(source(), version))
        # queued for the next token boundary of the running batch; the job behind it on the
        # engine thread loads it if no batch is running (or the batch ends first)
        future: Future = Future()
        self._loads.put((source, version, future))
        self._executor.submit(self._take_loads)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _return_freed_memory(device: torch.device) -> None:
    """Hand freed tensor memory back to the system: CUDA's caching allocator keeps it for
    reuse, and glibc's malloc keeps heap pages below the top of its arenas."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:  # glibc only; other allocators return large blocks on free
        trim(0)


def _deliver(on_tokens: TokenSink,
             batch: list[tuple[int, int, float, list[tuple[int, float]] | None]]) -> None:
    for row, token, logprob, top in batch:
        on_tokens(row, [token], [logprob], None if top is None else [top])


def load_named_tensors(model: Any, weights: Iterable[tuple[str, Any]],
                       keep: str | None = None) -> int:
    """Copy tensors into `model` by parameter/buffer name; every parameter must be covered,
    except that the parameters under the prefix `keep` (a frozen vision tower) may all be
    left out, and then keep their values; some but not all of them is an error.

    Tied parameters (an lm_head sharing the embedding) may arrive under either name.
    """
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    covered: set[int] = set()
    count = 0
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"weights: {name!r} is not a parameter of the model "
                                 f"({type(model).__name__}); is this the same architecture?")
            tensor = torch.as_tensor(tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            covered.add(id(target))
            count += 1
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if keep is not None and missing:
        kept = [n for n in missing if n.startswith(keep)]
        if len(kept) == sum(1 for n, _ in model.named_parameters() if n.startswith(keep)):
            missing = [n for n in missing if not n.startswith(keep)]
    if missing:
        raise ValueError(f"weights: {len(missing)} parameters were not sent, e.g. {missing[:3]}")
    return count


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the model has no eos token (generation_config.eos_token_id, "
                         "tokenizer.eos_token) — cannot tell when a response ends")
    return ids


class _StopMatcher:
    """Finds a stop string in the decoded tail of a response, checked after every token."""

    def __init__(self, stops: Sequence[str], tokenizer: Any):
        self.stops = [s for s in stops if s]
        self.tokenizer = tokenizer
        # A token decodes to at least one character in practice; the margin covers byte pieces.
        self.window = max((len(s) for s in self.stops), default=0) + 8

    def match(self, tokens: list[int]) -> str | None:
        if not self.stops:
            return None
        tail = self.tokenizer.decode(tokens[-self.window:], skip_special_tokens=True)
        hits = [(tail.find(s) + len(s), s) for s in self.stops if s in tail]
        return min(hits)[1] if hits else None
