"""The request bodies the OpenAI-compatible endpoint accepts, as pydantic models: every field's
type and range in one place, so each bad value is a 400 `invalid_request_error` naming its field
(`openai_server` turns a `ValidationError` into that answer with `error_of`).

Numbers are strict (no strings, no booleans for numbers) and finite: JSON's `NaN` and `Infinity`
parse as floats in Python, and any of them anywhere in a body, a field this module names or an
extra one (`logit_bias.50256`, a vLLM option), is refused with its path. Unknown fields are
accepted and ignored, as OpenAI-compatible servers do, except the ones that would change the
sampling distribution without the engine applying them (penalties, `logit_bias`): those are
refused when set, since the experience's logprobs would not be the distribution the client asked
for.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

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


# top alternatives per token, as OpenAI caps them
MAX_TOP_LOGPROBS = 20


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """The first NaN or infinite number under `value`, with its dotted path."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub, v in items:
        if (hit := _non_finite(v, sub)) is not None:
            return hit
    return None


class _Body(BaseModel):
    """What both routes take: the model, how many samples, how to sample, how to answer.
    A field sent as null is left out (some clients send every field)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: Any = None
    n: int | None = Field(default=None, ge=1, description="samples of each prompt (1)")
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="-1 (vLLM) or 0: off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(default=None, ge=1)
    # vLLM's extras, which a RemoteEngine sends
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = Field(
        default=None, description="false: content keeps special tokens' text (an eos)")

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, body: Any) -> Any:
        if (hit := _non_finite(body, "")) is not None:
            raise PydanticCustomError("non_finite", "{field} must be a finite number, got "
                                      "{value}", {"field": hit[0], "value": repr(hit[1])})
        return body

    @model_validator(mode="after")
    def _served(self) -> _Body:
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key):
                raise PydanticCustomError(
                    "not_served", "{field} is not served: the engine samples without penalties, "
                    "so the experience would not carry the distribution asked for; leave it out "
                    "or 0", {"field": key, "value": repr(getattr(self, key))})
        if self.repetition_penalty not in (None, 1.0):
            raise PydanticCustomError("not_served", "{field} is not served: the engine samples "
                                      "without penalties; leave it out or 1",
                                      {"field": "repetition_penalty",
                                       "value": repr(self.repetition_penalty)})
        if self.logit_bias:
            raise PydanticCustomError("not_served", "{field} is not served: the engine samples "
                                      "without biases; leave it out", {"field": "logit_bias",
                                                                       "value": "..."})
        if self.best_of not in (None, self.n or 1):
            raise PydanticCustomError("not_served", "{field} is not served: ask for n samples",
                                      {"field": "best_of", "value": repr(self.best_of)})
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop or ()):
            raise PydanticCustomError("bad_stop", "{field} must be a non-empty string or a list "
                                      "of them", {"field": "stop", "value": repr(self.stop)})
        return self

    @property
    def tokens_key(self) -> str:
        """The field that set the response's length (`max_completion_tokens` over `max_tokens`)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", True))


class ChatBody(_Body):
    """`POST /v1/chat/completions`."""

    messages: list[Any] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("needs_logprobs", "{field} needs logprobs: true",
                                      {"field": "top_logprobs", "value": repr(self.top_logprobs)})
        return self


class CompletionBody(_Body):
    """`POST /v1/completions`; `logprobs` is the number of top alternatives (0: the sampled
    token's alone)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None


def error_of(exc: ValidationError) -> tuple[str, str]:
    """(param, message) of the first error: the field's path and what is wrong with it."""
    err = exc.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    loc = [str(p) for p in err.get("loc", ()) if not str(p).startswith(("function-", "union["))]
    # a union (stop: str | list) reports one error per branch: the field is its first part
    param = ctx.get("field") or (loc[0] if loc and err["type"] != "missing" else
                                 ".".join(loc)) or None
    if err["type"] in ("non_finite", "not_served", "bad_stop", "needs_logprobs"):
        return param, err["msg"]
    where = ".".join(loc) or param
    value = err.get("input")
    shown = "" if err["type"] == "missing" else f", got {value!r}"[:120]
    return param, f"{where}: {err['msg'][0].lower()}{err['msg'][1:]}{shown}"
