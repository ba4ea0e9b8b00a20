"""`RemoteEngine`: rollouts on an OpenAI-compatible server that runs elsewhere (`vllm serve`, or
another tandem explorer's endpoint), for explorers whose inference is not in their own process.

Generation goes through the server's `/v1/completions` route with the official `openai` client:
tandem tokenizes (the same ids as the other engines) and sends token ids, one request per prompt
with `n` samples, and asks for what an experience needs and OpenAI's API leaves out, through
vLLM's documented extra fields: `return_token_ids` (the sampled ids, not text to re-tokenize),
`logprobs` (the sampled token's log-probability), `include_stop_str_in_output`, `top_k` and
`ignore_eos`. A server that does not send back a logprob and a token id for every sampled token
is refused at start, naming what is missing.

New weights reach the server by checkpoint version: tandem asks it to reload
`run_dir/weights/v{N}` through vLLM's development routes (served under
`VLLM_SERVER_DEV_MODE=1`): `POST /collective_rpc` with a worker method, then
`POST /reset_prefix_cache` (a prefix cached under the old weights would give stale logprobs).
A prompt that shows images (`ImagePrompt`, docs/vision.md) goes through `/v1/chat/completions`
instead: its chat with each image as a base64 `data:` URL content part, so the server renders
and widens the placeholders with its own processor; `return_token_ids` brings back the prompt's
ids as the server widened them (what the experience records) and the sampled ids, with a
logprob per token.

The method is vLLM's own `reload_weights(weights_path=...)` (`reload: vllm`), or tandem's
`tandem_load_checkpoint` (`reload: tandem`, a server started with tandem's worker extension:
the manifest's checksums checked, unknown names refused before anything is loaded, and a tied
`lm_head` re-derived, which vLLM's reload leaves stale on its CPU backend). The server must see
the folder at the same path. There is no broadcast into a remote server: `sync.method: nccl` is
a config error with this engine.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np
import openai
import structlog

from .engine import (
    Completion, ImagePrompt, Prompt, WorkerFetchEngine, encode_prompts, in_requests)
from .sampling import SamplingParams

log = structlog.get_logger(__name__)


RELOADS = ("vllm", "tandem")


class RemoteEngineError(ValueError):
    """The server refused a request or lacks something tandem needs; names the config key."""


class RemoteEngine(WorkerFetchEngine):
    """An engine over a remote OpenAI-compatible server; its workers reload checkpoints."""

    def __init__(self, url: str, tokenizer: Any, *, model: str, api_key: str | None = None,
                 timeout: float = 600.0, max_concurrency: int = 64,
                 max_model_len: int | None = None, seed: int = 0, reload: str = "vllm"):
        if reload not in RELOADS:
            raise RemoteEngineError(f"engine.reload {reload!r}: expected one of {RELOADS}")
        self.reload = reload
        self.url = url.rstrip("/")
        self.root = self.url.removesuffix("/v1")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_concurrency = max_concurrency
        self.max_model_len = max_model_len
        self.seed = seed
        self.version = 0
        self._tokenizer = tokenizer
        self._calls = itertools.count()
        # per event loop: an httpx pool and a semaphore belong to the loop that made them
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._loading: asyncio.Event | None = None

    @classmethod
    def connect(cls, url: str, tokenizer_path: str, *, api_key: str | None = None,
                served_model: str | None = None, timeout: float = 600.0,
                max_concurrency: int = 64, seed: int = 0,
                reload: str = "vllm") -> RemoteEngine:
        """Check the server (reachable, serving the model, returning token ids and logprobs)
        and return an engine over it; blocking, like the other engines' `from_pretrained`."""
        from tandem.weights.hf import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path)
        client = openai.OpenAI(base_url=url, api_key=api_key or "none",
                               timeout=min(timeout, 30.0), max_retries=1)
        try:
            try:
                models = client.models.list().data
            except openai.APIConnectionError as exc:
                raise RemoteEngineError(f"engine.url {url}: cannot reach the server "
                                        f"({_reason(exc)})") from None
            except openai.APIStatusError as exc:
                raise RemoteEngineError(f"engine.url {url}: GET /models answered "
                                        f"{exc.status_code} ({_message(exc)})"
                                        + ("; check engine.api_key" if exc.status_code in
                                           (401, 403) else "")) from None
            names = [m.id for m in models]
            model = served_model or (names[0] if len(names) == 1 else None)
            if model is None or model not in names:
                raise RemoteEngineError(
                    f"engine.served_model: the server at {url} serves {names}; "
                    + (f"not {served_model!r}" if served_model else "name one"))
            card = next(m for m in models if m.id == model)
            max_len = getattr(card, "max_model_len", None)
            engine = cls(url, tokenizer, model=model, api_key=api_key, timeout=timeout,
                         max_concurrency=max_concurrency, seed=seed, reload=reload,
                         max_model_len=int(max_len) if isinstance(max_len, int) else None)
            probe = tokenizer("1").input_ids or [0]
            try:
                reply = client.completions.create(**engine._request(
                    probe, 1, SamplingParams(temperature=0.0, max_tokens=2), None))
            except openai.APIError as exc:
                raise RemoteEngineError(f"engine.url {url}: a token-id completion with "
                                        f"logprobs failed: {_message(exc)}") from None
            engine._completion(probe, reply.choices[0], 0.0)  # raises naming what is missing
        finally:
            client.close()
        log.info("remote.connected", url=url, model=model, max_model_len=engine.max_model_len)
        return engine

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def takes_images(self) -> bool:
        return True  # the server's model decides; a text-only one refuses the request

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, prompts: Sequence[Prompt], n: int,
                       sampling: SamplingParams) -> list[list[Completion]]:
        shown = {i: p for i, p in enumerate(prompts) if isinstance(p, ImagePrompt)}
        for i, p in shown.items():
            if not p.messages:
                raise RemoteEngineError(f"prompt {i} shows images without its chat "
                                        "(ImagePrompt.messages): the server renders it")
        encoded = encode_prompts(
            self._tokenizer, [p.ids if isinstance(p, ImagePrompt) else p for p in prompts], n,
            max_model_len=self.max_model_len,
            too_long=lambda index, length: RemoteEngineError(
                f"engine.url {self.url}: prompt {index} has {length} tokens, the server's "
                f"max_model_len is {self.max_model_len}"))
        client, _ = self._bind()
        call = next(self._calls)
        start = time.perf_counter()

        async def one(index: int, ids: list[int], part: int,
                      per_request: int) -> list[Completion]:
            # each prompt its own seeds (the server seeds sample k with seed + k), so equal
            # prompts in one call differ and a seeded call reproduces; unseeded calls differ
            base = sampling.seed if sampling.seed is not None else (
                self.seed * 1_000_003 + call) * 65_536
            seed = base + index * n + part
            while self._loading is not None:
                await self._loading.wait()
            self._in_flight += 1
            self._idle.clear()
            try:
                async with self._slots:
                    if index in shown:
                        reply = await client.chat.completions.create(
                            **self._chat_request(shown[index], per_request, sampling, seed))
                    else:
                        reply = await client.completions.create(
                            **self._request(ids, per_request, sampling, seed))
            except openai.APITimeoutError:
                raise RemoteEngineError(f"engine.request_timeout: the server at {self.url} did "
                                        f"not answer within {self.timeout:g}s") from None
            except openai.APIConnectionError as exc:
                raise RemoteEngineError(f"engine.url {self.url}: the server is gone "
                                        f"({_reason(exc)})") from None
            except openai.APIStatusError as exc:
                raise RemoteEngineError(f"engine.url {self.url}: the server refused prompt "
                                        f"{index} ({exc.status_code}: {_message(exc)})") from None
            finally:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.set()
            seconds = time.perf_counter() - start
            choices = sorted(reply.choices, key=lambda c: c.index)
            if len(choices) != per_request:
                raise RemoteEngineError(f"engine.url {self.url}: asked for {per_request} "
                                        f"samples, the server returned {len(choices)}")
            if index in shown:
                return [self._chat_completion(reply, c, seconds) for c in choices]
            return [self._completion(ids, c, seconds) for c in choices]

        return await in_requests(encoded, n, sampling, one)

    def _request(self, ids: list[int], n: int, sampling: SamplingParams,
                 seed: int | None) -> dict[str, Any]:
        room = self.max_model_len - len(ids) if self.max_model_len else sampling.max_tokens
        return dict(
            model=self.model, prompt=[ids], n=n, temperature=sampling.temperature,
            top_p=sampling.top_p, max_tokens=min(sampling.max_tokens, room),
            stop=list(sampling.stop) or None, seed=seed, logprobs=1,
            extra_body={"top_k": sampling.top_k, "ignore_eos": sampling.ignore_eos,
                        "include_stop_str_in_output": True, "return_token_ids": True,
                        "skip_special_tokens": True})

    def _chat_request(self, prompt: ImagePrompt, n: int, sampling: SamplingParams,
                      seed: int | None) -> dict[str, Any]:
        """A chat completion of an image prompt: each `{"type": "image"}` part of its chat
        becomes the next image as a base64 data: URL."""
        urls = iter("data:image/png;base64," + base64.b64encode(b).decode()
                    for b in prompt.images)
        messages = []
        for m in prompt.messages or ():
            content = m.get("content")
            if isinstance(content, list):
                m = {**m, "content": [
                    {"type": "image_url", "image_url": {"url": next(urls)}}
                    if isinstance(p, dict) and p.get("type") == "image" else p
                    for p in content]}
            messages.append(m)
        plain = self._request([], n, sampling, seed)
        plain.pop("prompt")
        return dict(plain, messages=messages, logprobs=True)

    def _chat_completion(self, reply: Any, choice: Any, seconds: float) -> Completion:
        prompt_ids = (getattr(choice, "prompt_token_ids", None)
                      or getattr(reply, "prompt_token_ids", None))
        if not prompt_ids:
            raise RemoteEngineError(
                f"engine.url {self.url}: a chat completion returned no prompt token ids "
                "(`return_token_ids`); an image prompt's ids are the server's to widen")
        content = getattr(choice.logprobs, "content", None) if choice.logprobs else None
        values = [e.logprob for e in content] if content else None
        return self._completion(list(prompt_ids), choice, seconds, values)

    def _completion(self, prompt_ids: list[int], choice: Any, seconds: float,
                    values: list[float] | None = None) -> Completion:
        token_ids = getattr(choice, "token_ids", None)
        if token_ids is None:
            raise RemoteEngineError(
                f"engine.url {self.url}: the server returned no token ids (vLLM's "
                "`return_token_ids` request field); RemoteEngine needs a server that sends "
                "the sampled ids, such as `vllm serve` or a tandem explorer's endpoint")
        lp = choice.logprobs
        if values is None:
            values = getattr(lp, "token_logprobs", None) if lp is not None else None
        if values is None or len(values) != len(token_ids) or any(v is None for v in values):
            raise RemoteEngineError(
                f"engine.url {self.url}: the server returned no logprob for some sampled "
                "tokens (`logprobs` on /v1/completions); RemoteEngine needs one per token")
        reason = choice.finish_reason
        stop_reason = getattr(choice, "stop_reason", None)
        if reason == "length":
            finish, stop = "length", None
        elif reason != "stop":
            raise RemoteEngineError(f"engine.url {self.url}: a completion ended with "
                                    f"{reason!r}")
        elif isinstance(stop_reason, str):
            finish, stop = "stop", stop_reason
        else:
            finish, stop = "eos", None  # an eos (or stop) token ended it
        tokens = np.asarray(token_ids, dtype=np.int32)
        return Completion(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32), token_ids=tokens,
            logprobs=np.asarray(values, dtype=np.float32),
            text=self._tokenizer.decode(tokens.tolist(), skip_special_tokens=True),
            finish_reason=finish, stop=stop, timings={"generate_s": seconds})

    # -- weights -------------------------------------------------------------------------------

    async def fetch_checkpoint(self, run_dir: str, version: int) -> int:
        """The server reloads `run_dir/weights/v{version}` (the same path on its side), with
        this engine's requests drained first and new ones held until it is done."""
        from tandem.weights import WeightSubscriber, version_dir

        tensors = len(WeightSubscriber(run_dir, verify=False).manifest(version).tensors)
        path = str(version_dir(run_dir, version).resolve())
        self._bind()
        while self._loading is not None:  # one load at a time
            await self._loading.wait()
        self._loading = asyncio.Event()
        try:
            await self._idle.wait()  # requests already sent finish under the old weights
            # the dev route passes strings only
            await self._admin("/collective_rpc", {
                "method": "reload_weights", "kwargs": {"weights_path": path}}
                if self.reload == "vllm" else {
                "method": "tandem_load_checkpoint",
                "args": [str(Path(run_dir).resolve()), str(version)]})
            await self._admin("/reset_prefix_cache", None)
        finally:
            loading, self._loading = self._loading, None
            loading.set()
        self.version = version
        return tensors

    async def _admin(self, route: str, body: dict[str, Any] | None) -> None:
        _, admin = self._bind()
        try:
            await admin.post(route, body=body, cast_to=object)
        except openai.APIConnectionError as exc:
            raise RemoteEngineError(f"engine.url {self.url}: the server is gone "
                                    f"({_reason(exc)})") from None
        except openai.APIStatusError as exc:
            hint = (" (vLLM serves it with VLLM_SERVER_DEV_MODE=1 set)"
                    if exc.status_code in (404, 405) else "")
            raise RemoteEngineError(f"engine.url {self.url}: the server cannot reload weights: "
                                    f"POST {route} answered {exc.status_code}{hint}: "
                                    f"{_message(exc)}") from None

    async def join_group(self, rendezvous: dict[str, Any], explorer: str, timeout: float) -> None:
        raise RemoteEngineError("sync.method: nccl cannot reach engine.kind: remote; use "
                                "sync.method: checkpoint")

    async def fetch_broadcast(self, version: int) -> int:
        raise RemoteEngineError("sync.method: nccl cannot reach engine.kind: remote; use "
                                "sync.method: checkpoint")

    def _bind(self) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
        """The clients of the running loop (made anew when a caller brings another loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            key = self.api_key or "none"
            self._clients = (
                openai.AsyncOpenAI(base_url=self.url, api_key=key, timeout=self.timeout,
                                   max_retries=2),
                openai.AsyncOpenAI(base_url=self.root, api_key=key, timeout=self.timeout,
                                   max_retries=0))
            self._slots = asyncio.Semaphore(self.max_concurrency)
            self._idle = asyncio.Event()
            self._idle.set()
            self._in_flight = 0
            self._loop = loop
        return self._clients

    def close(self) -> None:
        """Close the clients' connections (the server keeps running: it is not ours)."""
        clients, self._clients, loop, self._loop = self._clients, None, self._loop, None
        if clients is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            for client in clients:
                loop.create_task(client.close())
        elif not loop.is_running():
            for client in clients:
                loop.run_until_complete(client.close())


def _reason(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0]


def _message(exc: openai.APIError) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        text = inner.get("message") if isinstance(inner, dict) else inner
        if text is None and isinstance(inner, dict):
            text = inner.get("detail")
        if text:
            return str(text).strip().splitlines()[0]
    return str(exc.message).strip().splitlines()[0]
