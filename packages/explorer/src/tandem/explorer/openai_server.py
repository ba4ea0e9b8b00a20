"""The explorer's OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, served from the explorer's own engine (docs/explorer.md#openai-endpoint).

Agents written against OpenAI's API call it; every call made for an open episode is recorded
(`openai_calls.CallLog`) with the exact token ids the model saw and produced, the behaviour
logprobs and the policy version.

- **Episode id: the API key.** tandem hands each episode a client whose API key is the episode id,
  so it rides in the `Authorization` header of every request the client makes, on every route,
  without the agent's code passing anything: a `user` field or an extra header would have to be
  set on each call by code tandem does not control. A key that names no open episode is served
  and not recorded.
- **The model's own chat template.** Messages render through the tokenizer's template. An
  assistant message that repeats a response this episode received (matched by its tool call ids,
  else its text) is spliced in as the token ids the model produced, never re-tokenized, so a
  conversation the agent extends is the model's own tokens plus what was added in between.
- **Batching.** Requests that arrive within `openai.batch_window` of each other and sample the
  same way share one engine call, so concurrent episodes batch as a workflow's rollouts do.
- **Streaming** answers in server-sent events; the engine samples a whole batch at once, so the
  chunks are sent when the completion is done, one per token.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.common.config.explorer import OpenAIConfig

from .engine import Completion, Engine
from .openai_calls import CallLog, CallRecord
from .sampling import SamplingParams

log = structlog.get_logger(__name__)

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class APIError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type, code and the offending param."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type, code, param)

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status)


# -- batching -----------------------------------------------------------------------------------


@dataclass
class _Pending:
    prompt: list[int]
    n: int
    future: asyncio.Future


class EngineBatcher:
    """Collects concurrent requests that sample the same way into one `engine.generate` call."""

    def __init__(self, engine: Engine, window: float):
        self.engine = engine
        self.window = window
        self.max_rows = int(getattr(engine, "max_batch", 0) or 256)
        self._queues: dict[SamplingParams, list[_Pending]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def generate(self, prompt: list[int], n: int,
                       sampling: SamplingParams) -> list[Completion]:
        future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(sampling, []).append(_Pending(prompt, n, future))
        self._wake.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            if self.window:
                # a burst of requests trickles in: wait while more keep arriving (up to 8
                # windows, or a full batch), so one burst is one engine call
                seen = -1
                for _ in range(8):
                    count = sum(len(q) for q in self._queues.values())
                    if count == seen or count >= self.max_rows:
                        break
                    seen = count
                    await asyncio.sleep(self.window)
            self._wake.clear()
            for sampling in list(self._queues):
                pending = [p for p in self._queues.pop(sampling) if not p.future.done()]
                # at most one engine batch per call: the rest waits its turn in the queue, and
                # requests keep being parsed while the engine samples
                take, rows = [], 0
                while pending and (not take or rows + pending[0].n <= self.max_rows):
                    rows += pending[0].n
                    take.append(pending.pop(0))
                if pending:
                    self._queues[sampling] = pending + self._queues.get(sampling, [])
                    self._wake.set()
                if take:
                    await self._run(sampling, take)

    async def _run(self, sampling: SamplingParams, pending: list[_Pending]) -> None:
        # each of a request's n samples is its own row: one call serves mixed n
        rows = [p.prompt for p in pending for _ in range(p.n)]
        try:
            out = await self.engine.generate(rows, 1, sampling)
        except Exception as exc:
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self.batches += 1
        flat = [choices[0] for choices in out]
        start = 0
        for p in pending:
            if not p.future.done():
                p.future.set_result(flat[start:start + p.n])
            start += p.n

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for pending in self._queues.values():
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(APIError(503, "the endpoint is shutting down",
                                                    type="server_error", code="shutting_down"))


# -- the endpoint -------------------------------------------------------------------------------


@dataclass
class _Request:
    """What both routes need after validation."""

    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    stream: bool
    logprobs: bool
    episode: str | None
    tools: bool = False
    # vLLM's extra fields, which a RemoteEngine sends: the ids, and the stop string kept
    token_ids: bool = False
    keep_stop: bool = False


class OpenAIEndpoint:
    """The endpoint as a component: `await start()`, then `url`; `close()` when done."""

    def __init__(self, config: OpenAIConfig, engine: Engine, *, sampling: SamplingParams,
                 context: int | None, name: str = "explorer", url_dir: str | Path | None = None):
        self.config = config
        self.engine = engine
        self.default_sampling = sampling
        self.context = config.max_context or context
        self.name = name
        self.url_dir = Path(url_dir) if url_dir is not None else None
        self.calls = CallLog()
        self.batcher = EngineBatcher(engine, config.batch_window)
        self.tokenizer = engine.tokenizer
        self.eos_ids = set(getattr(engine, "eos_ids", None) or {self.tokenizer.eos_token_id})
        self._in_flight = 0
        self.rejected = 0
        self.served = 0
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self.url = ""
        self.app = self._build_app()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind `openai.address` and serve; returns the base URL (`http://host:port/v1`)."""
        host, _, port = self.config.address.rpartition(":")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), int(port)))
        except OSError as exc:
            sock.close()
            raise OSError(f"openai.address {self.config.address}: cannot bind ({exc})") from None
        sock.listen(1024)
        sock.setblocking(False)
        self._socket = sock
        bound = sock.getsockname()[1]
        self.url = f"http://{host}:{bound}/v1"
        self.batcher.start()
        self._server = _EmbeddedServer(uvicorn.Config(
            self.app, log_level="warning", lifespan="off", access_log=False,
            timeout_graceful_shutdown=2))
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise RuntimeError(f"openai endpoint at {self.url} stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"openai endpoint at {self.url} did not start in 10s")
            await asyncio.sleep(0.01)
        if self.url_dir is not None:
            self.url_dir.mkdir(parents=True, exist_ok=True)
            (self.url_dir / f"{self.name}.url").write_text(self.url + "\n")
        log.info("openai.started", explorer=self.name, url=self.url, model=self.config.model,
                 max_concurrency=self.config.max_concurrency)
        return self.url

    async def close(self) -> None:
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._serve_task, 5.0)
            except (TimeoutError, asyncio.CancelledError):
                self._serve_task.cancel()
            self._server = None
        await self.batcher.close()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        log.info("openai.closed", explorer=self.name, served=self.served, rejected=self.rejected,
                 unrecorded=self.calls.unrecorded)

    # -- routes --------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
            log.error("openai.error", path=request.url.path, error=repr(exc))
            return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                            type="server_error").response()

        @app.exception_handler(404)
        async def _no_route(request: Request, exc: Exception) -> JSONResponse:
            return APIError(404, f"no route {request.method} {request.url.path}",
                            code="not_found").response()

        @app.exception_handler(405)
        async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
            return APIError(405, f"{request.method} is not allowed on {request.url.path}",
                            code="method_not_allowed").response()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model}")
        async def model(model: str) -> Any:
            if model != self.config.model:
                return self._unknown_model(model).response()
            return self._model_card()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self._serve(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self._serve(request, "completion")

        return app

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": self.context, "policy_version": self.engine.version}

    def _unknown_model(self, model: Any) -> APIError:
        return APIError(404, f"model {model!r} does not exist; this endpoint serves "
                        f"{self.config.model!r} (explorers[].openai.model)",
                        code="model_not_found", param="model")

    async def _serve(self, request: Request, route: str) -> Any:
        if self._in_flight >= self.config.max_concurrency:
            self.rejected += 1
            return APIError(429, f"{self._in_flight} requests in flight, the limit is "
                            f"{self.config.max_concurrency} (explorers[].openai.max_concurrency); "
                            "retry", type="rate_limit_error", code="rate_limit_exceeded").response()
        self._in_flight += 1
        try:
            body = await self._json(request)
            episode = _api_key(request)
            req = (self._chat_request(body, episode) if route == "chat"
                   else self._completion_request(body, episode))
            created = int(time.time())
            results = await asyncio.gather(*(self.batcher.generate(p, req.n, req.sampling)
                                             for p in req.prompts))
            version = self.engine.version
            self.served += 1
            if route == "chat":
                payload, records = self._chat_payload(req, results[0], version, created)
            else:
                payload, records = self._completion_payload(req, results, version, created)
        except APIError as exc:
            return exc.response()
        except Exception as exc:
            log.error("openai.error", explorer=self.name, route=route, error=repr(exc))
            return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}",
                            type="server_error", code="engine_error").response()
        finally:
            self._in_flight -= 1
        if req.stream:
            chunks = (self._chat_chunks(payload, req) if route == "chat"
                      else self._completion_chunks(payload))
            return StreamingResponse(self._sse(chunks, records), media_type="text/event-stream")
        self.calls.add(records)
        return payload

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    # -- validation ----------------------------------------------------------------------------

    def _common(self, body: dict[str, Any], episode: str | None) -> dict[str, Any]:
        if body.get("model") != self.config.model:
            raise self._unknown_model(body.get("model"))
        n = _int(body, "n", 1, low=1)
        if n > self.config.max_n:
            raise APIError(400, f"n = {n} is over this endpoint's limit of {self.config.max_n} "
                           "(explorers[].openai.max_n)", param="n", code="n_too_large")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = _int(body, key, self.default_sampling.max_tokens, low=1)
        if max_tokens > self.config.max_tokens:
            raise APIError(400, f"{key} = {max_tokens} is over this endpoint's limit of "
                           f"{self.config.max_tokens} (explorers[].openai.max_tokens)",
                           param=key, code="max_tokens_too_large")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "stop must be a non-empty string or a list of them", param="stop")
        d = self.default_sampling
        try:
            sampling = SamplingParams(
                temperature=_num(body, "temperature", d.temperature),
                top_p=_num(body, "top_p", d.top_p),
                top_k=max(0, _int(body, "top_k", d.top_k, low=-1)),  # -1 is vLLM's "off"
                max_tokens=max_tokens, stop=tuple(stop), seed=_int(body, "seed", d.seed, low=None),
                ignore_eos=bool(body.get("ignore_eos", d.ignore_eos)))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return {"n": n, "sampling": sampling, "stream": bool(body.get("stream", False)),
                "episode": episode, "token_ids": bool(body.get("return_token_ids")),
                "keep_stop": bool(body.get("include_stop_str_in_output"))}

    def _check_context(self, prompt: list[int], sampling: SamplingParams, index: int = 0) -> None:
        if not prompt:
            raise APIError(400, f"prompt {index} is empty", param="prompt")
        if self.context is not None and len(prompt) + sampling.max_tokens > self.context:
            raise APIError(
                400, f"this model's context is {self.context} tokens; the prompt has "
                f"{len(prompt)} and max_tokens asks for {sampling.max_tokens} more; shorten "
                "the prompt or lower max_tokens", param="messages",
                code="context_length_exceeded")

    def _chat_request(self, body: dict[str, Any], episode: str | None) -> _Request:
        common = self._common(body, episode)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "tools must be a list", param="tools")
        if body.get("top_logprobs"):
            raise APIError(400, "top_logprobs is not served: the engine returns the sampled "
                           "token's logprob only; ask for logprobs: true", param="top_logprobs")
        prompt = self._render_chat(messages, tools, episode)
        self._check_context(prompt, common["sampling"])
        return _Request(prompts=[prompt], logprobs=bool(body.get("logprobs")),
                        tools=tools is not None, **common)

    def _completion_request(self, body: dict[str, Any], episode: str | None) -> _Request:
        common = self._common(body, episode)
        if body.get("echo"):
            raise APIError(400, "echo is not served", param="echo")
        raw = body.get("prompt")
        if isinstance(raw, str) or (isinstance(raw, list) and raw
                                    and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise APIError(400, "prompt must be a string, a list of strings, a list of token "
                           "ids or a list of those", param="prompt")
        prompts = []
        vocab = len(self.tokenizer)
        for i, p in enumerate(raw):
            if isinstance(p, str):
                prompts.append(list(self.tokenizer(p).input_ids))
            elif isinstance(p, list) and all(isinstance(t, int) and 0 <= t < vocab for t in p):
                prompts.append(list(p))
            else:
                raise APIError(400, f"prompt {i} is neither a string nor token ids below "
                               f"{vocab}", param="prompt")
            self._check_context(prompts[-1], common["sampling"], i)
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0, 1) and logprobs is not True:
            raise APIError(400, "logprobs above 1 (top alternatives) is not served: the engine "
                           "returns the sampled token's logprob only", param="logprobs")
        return _Request(prompts=prompts, logprobs=logprobs is not None, **common)

    # -- the chat template ---------------------------------------------------------------------

    def _render_chat(self, messages: list[Any], tools: list[Any] | None,
                     episode: str | None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "the model's tokenizer has no chat template; use /v1/completions",
                           code="no_chat_template")
        rendered, splices = [], {}
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a role",
                               param="messages")
            m = _plain_message(m)
            if m["role"] == "assistant":
                ids = tuple(c.get("id", "") for c in m.get("tool_calls") or ())
                rec = self.calls.find_assistant(episode, m.get("content"), ids)
                if rec is not None:
                    sentinel = f"\x00tandem-turn-{len(splices)}\x00"
                    splices[sentinel] = rec.token_ids
                    rendered.append({"role": "assistant", "content": sentinel})
                    continue
            rendered.append(m)
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise APIError(400, f"the chat template cannot render these messages: {exc}",
                           param="messages") from None
        if splices and not all(s in text for s in splices):
            # a template that rewrites assistant content: render the messages as they came
            text = self.tokenizer.apply_chat_template(
                [_plain_message(m) for m in messages], tools=tools, tokenize=False,
                add_generation_prompt=True)
            splices = {}
        ids: list[int] = []
        pieces = re.split("(" + "|".join(map(re.escape, splices)) + ")", text) if splices \
            else [text]
        after_eos = False
        for piece in pieces:
            if piece in splices:
                ids += splices[piece]
                after_eos = bool(splices[piece]) and splices[piece][-1] in self.eos_ids
                continue
            seg = self._encode(piece)
            if after_eos and seg and seg[0] == ids[-1]:
                seg = seg[1:]  # the model's eos already closes its turn: not twice
            ids += seg
            after_eos = False
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    # -- answers -------------------------------------------------------------------------------

    def _text_of(self, c: Completion, keep_stop: bool = False) -> str:
        text = c.text
        if c.finish_reason == "stop" and c.stop and c.stop in text and not keep_stop:
            text = text[:text.rfind(c.stop)]  # OpenAI returns the text before the stop string
        return text

    def _finish(self, c: Completion) -> str:
        return "length" if c.finish_reason == "length" else "stop"

    def _token_logprobs(self, c: Completion) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(c.token_ids.tolist(), c.logprobs.tolist()):
            s = self.tokenizer.decode([t])
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": []})
        return out

    def _chat_payload(self, req: _Request, choices: list[Completion], version: int,
                      created: int) -> tuple[dict[str, Any], list[CallRecord]]:
        out, records = [], []
        for i, c in enumerate(choices):
            text = self._text_of(c, req.keep_stop)
            finish = self._finish(c)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls = _parse_tool_calls(text) if req.tools else []
            if calls:
                message["tool_calls"] = calls
                message["content"] = _TOOL_CALL.sub("", text).strip() or None
                finish = "tool_calls"
            out.append({"index": i, "message": message, "finish_reason": finish,
                        "stop_reason": c.stop,
                        "logprobs": {"content": self._token_logprobs(c)} if req.logprobs
                        else None, **self._ids(req, c)})
            records.append(self._record(req, "chat", c, version, finish, message["content"],
                                        tuple(tc["id"] for tc in calls)))
        payload = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                   "created": created, "model": self.config.model, "choices": out,
                   "usage": _usage(choices), "system_fingerprint": f"policy-v{version}"}
        return payload, records

    def _completion_payload(self, req: _Request, results: list[list[Completion]], version: int,
                            created: int) -> tuple[dict[str, Any], list[CallRecord]]:
        out, records, flat = [], [], []
        for choices in results:
            for c in choices:
                text = self._text_of(c, req.keep_stop)
                logprobs = None
                if req.logprobs:
                    tokens = [self.tokenizer.decode([t]) for t in c.token_ids.tolist()]
                    offsets, pos = [], 0
                    for s in tokens:
                        offsets.append(pos)
                        pos += len(s)
                    logprobs = {"tokens": tokens, "token_logprobs": c.logprobs.tolist(),
                                "top_logprobs": None, "text_offset": offsets}
                out.append({"index": len(out), "text": text, "finish_reason": self._finish(c),
                            "stop_reason": c.stop, "logprobs": logprobs, **self._ids(req, c)})
                records.append(self._record(req, "completion", c, version, self._finish(c),
                                            text, ()))
                flat.append(c)
        payload = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                   "created": created, "model": self.config.model, "choices": out,
                   "usage": _usage(flat), "system_fingerprint": f"policy-v{version}"}
        return payload, records

    @staticmethod
    def _ids(req: _Request, c: Completion) -> dict[str, Any]:
        """vLLM's `return_token_ids` answer: the prompt's and the response's token ids."""
        if not req.token_ids:
            return {}
        return {"prompt_token_ids": c.prompt_ids.tolist(), "token_ids": c.token_ids.tolist()}

    def _record(self, req: _Request, route: str, c: Completion, version: int, finish: str,
                content: str | None, tool_call_ids: tuple[str, ...]) -> CallRecord:
        return CallRecord(episode=req.episode or "", route=route,
                          prompt_ids=c.prompt_ids.tolist(), token_ids=c.token_ids.tolist(),
                          logprobs=c.logprobs.tolist(), version=version, finish_reason=finish,
                          content=content, tool_call_ids=tool_call_ids)

    # -- streaming -----------------------------------------------------------------------------

    def _chat_chunks(self, payload: dict[str, Any], req: _Request) -> Iterator[dict[str, Any]]:
        base = {"id": payload["id"], "object": "chat.completion.chunk",
                "created": payload["created"], "model": payload["model"],
                "system_fingerprint": payload["system_fingerprint"]}
        for choice in payload["choices"]:
            i, message = choice["index"], choice["message"]
            yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]}
            logprobs = (choice["logprobs"] or {}).get("content") or []
            content = message["content"] or ""
            if logprobs:  # one chunk per token: its text and its logprob
                for lp in logprobs:
                    yield {**base, "choices": [{"index": i, "delta": {"content": lp["token"]},
                                                "logprobs": {"content": [lp]},
                                                "finish_reason": None}]}
            elif content:
                yield {**base, "choices": [{"index": i, "delta": {"content": content},
                                            "finish_reason": None}]}
            if message.get("tool_calls"):
                calls = [{"index": k, **tc} for k, tc in enumerate(message["tool_calls"])]
                yield {**base, "choices": [{"index": i, "delta": {"tool_calls": calls},
                                            "finish_reason": None}]}
            yield {**base, "choices": [{"index": i, "delta": {},
                                        "finish_reason": choice["finish_reason"]}]}
        yield {**base, "choices": [], "usage": payload["usage"]}

    def _completion_chunks(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        base = {"id": payload["id"], "object": "text_completion", "created": payload["created"],
                "model": payload["model"]}
        for choice in payload["choices"]:
            yield {**base, "choices": [{**choice, "finish_reason": None}]}
            yield {**base, "choices": [{"index": choice["index"], "text": "", "logprobs": None,
                                        "finish_reason": choice["finish_reason"]}]}

    async def _sse(self, chunks: Iterator[dict[str, Any]], records: list[CallRecord]):
        """The events, then `[DONE]`; the call is recorded only once the client has it all
        (a client gone mid-stream never saw the response, so no later prompt extends it)."""
        complete = False
        try:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0)  # lets a disconnect be noticed between chunks
            yield "data: [DONE]\n\n"
            complete = True
        finally:
            if complete:
                self.calls.add(records)
            else:
                log.warning("openai.client_gone", explorer=self.name, episode=records[0].episode
                            if records else None, why="the client disconnected mid-stream; the "
                            "call is not recorded")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the explorer's loop: the explorer owns SIGTERM and SIGINT, so the server
    must not install handlers of its own."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def _int(body: dict[str, Any], key: str, default: Any, *, low: int | None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise APIError(400, f"{key} must be an integer" + (f" >= {low}" if low is not None
                                                           else "") + f", got {value!r}",
                       param=key)
    return value


def _num(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"{key} must be a number, got {value!r}", param=key)
    if not math.isfinite(value):  # JSON's NaN and Infinity parse as floats
        raise APIError(400, f"{key} must be a finite number, got {value!r}", param=key)
    return float(value)


def _plain_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: text parts joined, tool call arguments as maps."""
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if m.get("tool_calls"):
        calls = []
        for tc in m["tool_calls"]:
            fn = dict((tc or {}).get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**tc, "function": fn})
        m["tool_calls"] = calls
    return m


def _parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """Tool calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
    convention of Qwen's and Hermes' templates); a block that does not parse stays text."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        args = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args)}})
    return calls


def _usage(choices: list[Completion]) -> dict[str, int]:
    prompt = len(choices[0].prompt_ids) if choices else 0
    completion = sum(len(c) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def model_context(model_path: str | Path) -> int | None:
    """The model's context length from its config.json (max_position_embeddings)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None
