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
  else its tool calls' names and arguments, else its text in any form the endpoint gave it:
  streamed or whole, with or without special tokens) is spliced in as the token ids the model
  produced, never re-tokenized, so a conversation the agent extends is the model's own tokens
  plus what was added in between.
- **Batching.** Requests that arrive within `openai.batch_window` of each other and sample the
  same way share one engine call, so concurrent episodes batch as a workflow's rollouts do.
- **Images.** A chat message's `image_url` content parts (base64 `data:` URLs; the endpoint
  reads no files and fetches no URLs) are checked and normalised as a taskset's are
  (`tandem.common.images`) and reach an engine that takes images as an `ImagePrompt`
  (docs/vision.md); an engine without them answers 400.
- **Streaming** answers in server-sent events as the engine samples (`Engine.generate_stream`):
  each decode step's tokens leave as a chunk, with their logprobs, while the batch goes on.
  Streamed and whole answers are cut into content and tool calls by the same
  `openai_stream.AnswerText`, so joined chunks are the whole answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from tandem.common.config.explorer import OpenAIConfig

from tandem.common.images import (
    BadImage, image_bytes, image_hash, is_image_part, normalise, part_image)

from .engine import Completion, Engine, ImagePrompt, Prompt, TokenSink
from .openai_batcher import EngineBatcher
from .openai_calls import CallLog, CallRecord
from .openai_requests import APIError, ChatBody, CompletionBody, error_of
from .openai_stream import AnswerText, logprob_entries, tool_call_deltas
from .sampling import SamplingParams

log = structlog.get_logger(__name__)


# -- the endpoint -------------------------------------------------------------------------------


@dataclass
class _Request:
    """What both routes need after validation."""

    prompts: list[Prompt]  # token ids, or an ImagePrompt (a chat with image parts)
    n: int
    sampling: SamplingParams
    stream: bool
    logprobs: bool
    episode: str | None
    tools: bool = False
    # vLLM's extra fields, which a RemoteEngine sends: the ids, and the stop string kept
    token_ids: bool = False
    keep_stop: bool = False
    skip_special: bool = True  # false: content keeps special tokens' text
    usage: bool = True  # a streamed answer ends with a usage chunk


@dataclass
class _Call:
    """One request being answered: each choice's text so far, then its completion."""

    req: _Request
    route: str  # "chat" or "completion"
    model: str
    answers: list[AnswerText]
    completions: list[Completion] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    key: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.key}" if self.route == "chat" else f"cmpl-{self.key}"

    def chunk(self, choices: list[dict[str, Any]], fingerprint: str | None = None,
              usage: dict[str, int] | None = None) -> dict[str, Any]:
        chat = self.route == "chat"
        out = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if fingerprint is not None:
            out["system_fingerprint"] = fingerprint
        if usage is not None:
            out["usage"] = usage
        return out


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
        streaming = False
        try:
            body = await self._json(request)
            episode = _api_key(request)
            req = (self._chat_request(body, episode) if route == "chat"
                   else self._completion_request(body, episode))
            call = _Call(req, route, self.config.model, [
                AnswerText(self.tokenizer, stops=req.sampling.stop, tools=req.tools,
                           keep_stop=req.keep_stop, skip_special=req.skip_special)
                for _ in range(len(req.prompts) * req.n)])
            if req.stream:
                streaming = True
                return StreamingResponse(self._stream(call, *self._start_stream(call)),
                                         media_type="text/event-stream")
            results = await asyncio.gather(*(self.batcher.generate(p, req.n, req.sampling)
                                             for p in req.prompts))
            self.served += 1
            call.completions = [c for choices in results for c in choices]
            for answer, c in zip(call.answers, call.completions):
                answer.push(c.token_ids.tolist())
                answer.finish(c.finish_reason, c.stop)
            payload = self._payload(call, self.engine.version)
        except APIError as exc:
            streaming = False
            return exc.response()
        except Exception as exc:
            streaming = False
            log.error("openai.error", explorer=self.name, route=route, error=repr(exc))
            return _engine_error(exc).response()
        finally:
            if not streaming:  # a stream is in flight until its generation ends (`_stream`)
                self._in_flight -= 1
        self.calls.add(self._records(call, self.engine.version))
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

    def _common(self, body: ChatBody | CompletionBody, episode: str | None) -> dict[str, Any]:
        if body.model != self.config.model:
            raise self._unknown_model(body.model)
        n = body.n or 1
        if n > self.config.max_n:
            raise APIError(400, f"n = {n} is over this endpoint's limit of "
                           f"{self.config.max_n} (explorers[].openai.max_n)", param="n",
                           code="n_too_large")
        key = body.tokens_key
        max_tokens = getattr(body, key) or self.default_sampling.max_tokens
        if max_tokens > self.config.max_tokens:
            raise APIError(400, f"{key} = {max_tokens} is over this endpoint's limit of "
                           f"{self.config.max_tokens} (explorers[].openai.max_tokens)",
                           param=key, code="max_tokens_too_large")
        d = self.default_sampling
        top = body.top_logprobs if isinstance(body, ChatBody) else body.logprobs
        try:
            sampling = SamplingParams(
                temperature=d.temperature if body.temperature is None else body.temperature,
                top_p=d.top_p if body.top_p is None else body.top_p,
                top_k=d.top_k if body.top_k is None else max(0, body.top_k),  # -1: vLLM's off
                max_tokens=max_tokens, stop=tuple(body.stop or ()),
                seed=d.seed if body.seed is None else body.seed,
                ignore_eos=bool(body.ignore_eos) or d.ignore_eos, top_logprobs=top or 0)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return {"n": n, "sampling": sampling, "stream": bool(body.stream), "episode": episode,
                "token_ids": bool(body.return_token_ids),
                "keep_stop": bool(body.include_stop_str_in_output),
                "skip_special": body.skip_special_tokens is not False,
                "usage": body.include_usage}

    def _check_context(self, prompt: list[int], sampling: SamplingParams, index: int = 0) -> None:
        if not prompt:
            raise APIError(400, f"prompt {index} is empty", param="prompt")
        if self.context is not None and len(prompt) + sampling.max_tokens > self.context:
            raise APIError(
                400, f"this model's context is {self.context} tokens; the prompt has "
                f"{len(prompt)} and max_tokens asks for {sampling.max_tokens} more; shorten "
                "the prompt or lower max_tokens", param="messages",
                code="context_length_exceeded")

    def _chat_request(self, raw: dict[str, Any], episode: str | None) -> _Request:
        body = _validated(ChatBody, raw)
        common = self._common(body, episode)
        images = self._chat_images(body.messages)
        prompt: Prompt = self._render_chat(body.messages, body.tools, episode)
        self._check_context(prompt, common["sampling"])
        if images:
            prompt = ImagePrompt(prompt, images, [image_hash(b) for b in images],
                                 [_plain_message(m) for m in body.messages])
        return _Request(prompts=[prompt], logprobs=bool(body.logprobs),
                        tools=body.tools is not None, **common)

    def _completion_request(self, raw: dict[str, Any], episode: str | None) -> _Request:
        body = _validated(CompletionBody, raw)
        common = self._common(body, episode)
        if body.echo:
            raise APIError(400, "echo is not served", param="echo")
        prompt = body.prompt
        batch = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
            else prompt
        if not batch:
            raise APIError(400, "prompt must be a string, a list of strings, a list of token "
                           "ids or a list of those", param="prompt")
        prompts = []
        vocab = len(self.tokenizer)
        for i, p in enumerate(batch):
            if isinstance(p, str):
                prompts.append(list(self.tokenizer(p).input_ids))
            elif all(0 <= t < vocab for t in p):
                prompts.append(list(p))
            else:
                raise APIError(400, f"prompt {i} has token ids outside the vocabulary "
                               f"(0..{vocab - 1})", param="prompt")
            self._check_context(prompts[-1], common["sampling"], i)
        return _Request(prompts=prompts, logprobs=body.logprobs is not None, **common)

    # -- the chat template ---------------------------------------------------------------------

    def _chat_images(self, messages: list[Any]) -> list[bytes]:
        """The normalised bytes of the messages' image parts, in order; APIError 400 naming
        the part for one that is not a readable image given inline."""
        images = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if not is_image_part(part):
                    continue
                where = f"messages[{i}].content[{j}]"
                if not self.engine.takes_images:
                    raise APIError(400, f"{where} is an image and this model takes none "
                                   "(docs/vision.md)", param="messages")
                value = part_image(part)
                if not (isinstance(value, str) and value.startswith("data:")):
                    raise APIError(400, f"{where}: an image must be a base64 data: URL (the "
                                   "endpoint fetches no URLs and reads no files)",
                                   param="messages")
                try:
                    images.append(normalise(image_bytes(value, None)))
                except BadImage as exc:
                    raise APIError(400, f"{where}: the image {exc}", param="messages") from None
        return images

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
                rec = self.calls.find_assistant(
                    episode, m.get("content"),
                    tuple(c.get("id", "") for c in m.get("tool_calls") or ()),
                    tuple((str((c.get("function") or {}).get("name")),
                           _canonical((c.get("function") or {}).get("arguments", {})))
                          for c in m.get("tool_calls") or ()))
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

    @staticmethod
    def _finish(answer: AnswerText, c: Completion) -> str:
        if answer.calls:
            return "tool_calls"
        return "length" if c.finish_reason == "length" else "stop"

    def _payload(self, call: _Call, version: int) -> dict[str, Any]:
        """The whole answer of a call that is not streamed."""
        req, out = call.req, []
        for i, (answer, c) in enumerate(zip(call.answers, call.completions)):
            content, tool_calls = answer.message
            if call.route == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if tool_calls:
                    message["tool_calls"] = tool_calls
                choice = {"index": i, "message": message,
                          "logprobs": {"content": self._logprobs(req, c.token_ids.tolist(),
                                                                 c.logprobs.tolist(),
                                                                 c.top_logprobs)}
                          if req.logprobs else None}
            else:
                choice = {"index": i, "text": content or "",
                          "logprobs": self._completion_logprobs(
                              req, c.token_ids.tolist(), c.logprobs.tolist(), c.top_logprobs, 0)
                          if req.logprobs else None}
            out.append({**choice, "finish_reason": self._finish(answer, c), "stop_reason": c.stop,
                        **self._ids(req, c)})
        return {"id": call.id, "object": "chat.completion" if call.route == "chat"
                else "text_completion", "created": call.created, "model": self.config.model,
                "choices": out, "usage": _usage(call.completions),
                "system_fingerprint": f"policy-v{version}"}

    def _logprobs(self, req: _Request, ids: list[int], logprobs: list[float],
                  top: Any) -> list[dict[str, Any]]:
        return logprob_entries(self.tokenizer, ids, logprobs, top, req.sampling.top_logprobs)

    def _completion_logprobs(self, req: _Request, ids: list[int], logprobs: list[float],
                             top: Any, offset: int) -> dict[str, Any]:
        """`/v1/completions`' logprobs: tokens, their logprobs, the top alternatives as maps,
        and each token's offset in the text (`offset`: the text before these tokens)."""
        entries = self._logprobs(req, ids, logprobs, top)
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": ([{a["token"]: a["logprob"] for a in e["top_logprobs"]}
                                  for e in entries] if req.sampling.top_logprobs else None),
                "text_offset": offsets}

    @staticmethod
    def _ids(req: _Request, c: Completion) -> dict[str, Any]:
        """vLLM's `return_token_ids` answer: the prompt's and the response's token ids."""
        if not req.token_ids:
            return {}
        return {"prompt_token_ids": c.prompt_ids.tolist(), "token_ids": c.token_ids.tolist()}

    def _records(self, call: _Call, version: int) -> list[CallRecord]:
        out = []
        for answer, c in zip(call.answers, call.completions):
            content, tool_calls = answer.message
            out.append(CallRecord(
                episode=call.req.episode or "", route=call.route,
                prompt_ids=c.prompt_ids.tolist(), token_ids=c.token_ids.tolist(),
                logprobs=c.logprobs.tolist(), version=version,
                finish_reason=self._finish(answer, c), content=content,
                tool_call_ids=tuple(tc["id"] for tc in tool_calls),
                tool_calls=tuple((tc["function"]["name"], _canonical(tc["function"]["arguments"]))
                                 for tc in tool_calls),
                # a tool call's leftover content is no form of it; its raw text is
                texts=_forms(None if tool_calls else content,
                             *(self.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=k)
                               for k in (False, True)))))
        return out

    # -- streaming -----------------------------------------------------------------------------

    def _start_stream(self, call: _Call) -> tuple[asyncio.Task, asyncio.Queue]:
        """The call's generation, started now, and the queue its tokens arrive on (None when it
        ended). The request is in flight until the generation ends, whether or not anyone
        reads the stream."""
        req, events = call.req, asyncio.Queue()

        def sink(prompt: int) -> TokenSink:
            return lambda k, ids, lps, top: events.put_nowait((prompt * req.n + k, ids, lps, top))

        async def generate() -> list[list[Completion]]:
            return await asyncio.gather(*(self.batcher.generate(p, req.n, req.sampling, sink(i))
                                          for i, p in enumerate(req.prompts)))

        task = asyncio.create_task(generate())

        def ended(t: asyncio.Task) -> None:
            self._in_flight -= 1
            events.put_nowait(None)
            if not t.cancelled():
                t.exception()  # retrieved here: a client gone mid-stream never reads it

        task.add_done_callback(ended)
        return task, events

    async def _stream(self, call: _Call, task: asyncio.Task,
                      events: asyncio.Queue) -> AsyncIterator[str]:
        """Server-sent events as the engine samples: each step's tokens as a chunk per choice,
        then each choice's rest and finish reason, the usage and `[DONE]`. The call is recorded
        only once the client has it all (a client gone mid-stream never saw the response, so
        no later prompt extends it); its generation is given up then."""
        req, complete = call.req, False
        try:
            if call.route == "chat":
                for i in range(len(call.answers)):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                    if req.token_ids:  # vLLM's form: the prompt's ids in the first chunk
                        # an image prompt's ids before the engine widens its placeholders
                        prompt = req.prompts[i // req.n]
                        first["prompt_token_ids"] = list(
                            prompt.ids if isinstance(prompt, ImagePrompt) else prompt)
                    yield _sse(call.chunk([first]))
            while (event := await events.get()) is not None:
                for chunk in self._step_chunks(call, *event):
                    yield _sse(chunk)
            try:
                results = task.result()
            except Exception as exc:
                err = exc if isinstance(exc, APIError) else _engine_error(exc)
                log.error("openai.error", explorer=self.name, route=call.route, error=repr(exc))
                yield _sse({"error": {"message": err.message, "type": err.type,
                                      "param": err.param, "code": err.code}})
                return
            version = self.engine.version
            call.completions = [c for choices in results for c in choices]
            self.served += 1
            for i, (answer, c) in enumerate(zip(call.answers, call.completions)):
                text, tool_calls = answer.finish(c.finish_reason, c.stop)
                for chunk in self._delta_chunks(call, i, text, tool_calls, None):
                    yield _sse(chunk)
                last = {"index": i, "finish_reason": self._finish(answer, c),
                        "stop_reason": c.stop}
                last.update({"delta": {}, "logprobs": None} if call.route == "chat"
                            else {"text": "", "logprobs": None})
                yield _sse(call.chunk([last], f"policy-v{version}"))
            if req.usage:
                yield _sse(call.chunk([], f"policy-v{version}", usage=_usage(call.completions)))
            yield "data: [DONE]\n\n"
            complete = True
            self.calls.add(self._records(call, version))
        finally:
            if not task.done():
                task.cancel()
            if not complete:
                log.warning("openai.client_gone", explorer=self.name, episode=req.episode,
                            why="the stream ended before [DONE]; the call is not recorded")

    def _step_chunks(self, call: _Call, i: int, ids: list[int], logprobs: list[float],
                     top: Any) -> list[dict[str, Any]]:
        """The chunks of choice `i`'s newly sampled tokens: the text they release (none while a
        tool call or a possible stop string is being written), their logprobs."""
        answer = call.answers[i]
        offset = len("".join(answer.content))
        text, tool_calls = answer.push(ids)
        lp = None
        if call.req.logprobs:
            lp = ({"content": self._logprobs(call.req, ids, logprobs, top)}
                  if call.route == "chat" else
                  self._completion_logprobs(call.req, ids, logprobs, top, offset))
        return self._delta_chunks(call, i, text, tool_calls, lp,
                                  ids if call.req.token_ids else None)

    def _delta_chunks(self, call: _Call, i: int, text: str, tool_calls: list[dict[str, Any]],
                      logprobs: dict[str, Any] | None,
                      ids: list[int] | None = None) -> list[dict[str, Any]]:
        """Choice `i`'s chunks for newly released text, logprobs and token ids (`return_token_ids`:
        each chunk carries its tokens' ids, as vLLM streams them), then its new tool calls."""
        extra = {} if ids is None else {"token_ids": ids}
        if call.route != "chat":
            if not text and logprobs is None and ids is None:
                return []
            return [call.chunk([{"index": i, "text": text, "logprobs": logprobs,
                                 "finish_reason": None, **extra}])]
        out = []
        if text or logprobs is not None or ids is not None:
            out.append(call.chunk([{"index": i, "delta": {"content": text} if text else {},
                                    "logprobs": logprobs, "finish_reason": None, **extra}]))
        first = len(call.answers[i].calls) - len(tool_calls)
        for delta in tool_call_deltas(tool_calls, first):
            out.append(call.chunk([{"index": i, "delta": {"tool_calls": [delta]},
                                    "logprobs": None, "finish_reason": None}]))
        return out


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


def _plain_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: text parts joined (with image parts, the parts
    kept, each image as `{"type": "image"}`), tool call arguments as maps."""
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list) and any(is_image_part(p) for p in content):
        m["content"] = [{"type": "image"} if is_image_part(p) else
                        {"type": "text", "text": p.get("text", "")}
                        for p in content if isinstance(p, dict)]
    elif isinstance(content, list):
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


def _usage(choices: list[Completion]) -> dict[str, int]:
    prompt = len(choices[0].prompt_ids) if choices else 0
    completion = sum(len(c) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def _engine_error(exc: BaseException) -> APIError:
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type="server_error",
                    code="engine_error")


def _validated(model: type[ChatBody | CompletionBody], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        param, message = error_of(exc)
        raise APIError(400, message, param=param) from None


def _canonical(arguments: Any) -> str:
    """Tool call arguments in one spelling (parsed and dumped with sorted keys), for matching."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True)


def _forms(*texts: str | None) -> frozenset[str]:
    """The texts an assistant message repeating a response may carry, whitespace-trimmed: the
    content as answered, and the decoded tokens with and without special tokens' text."""
    return frozenset(t.strip() for t in texts if t is not None)


def model_context(model_path: str | Path) -> int | None:
    """The model's context length from its config.json (max_position_embeddings)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None
