"""One choice's answer as its tokens arrive: the text a client may be shown so far, the tool calls
parsed out of it, and each token's logprob entry.

Streamed and whole answers go through the same `AnswerText`, so a streamed answer's content,
joined, is the whole answer's content: text is released only when nothing after it can change it
(a stop string or a `<tool_call>` block that may be starting, half a UTF-8 character), special
tokens' text (an eos) is never content unless the request asks (`skip_special_tokens: false`),
and a tool call leaves as a tool call, never as its `<tool_call>` text.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_call(block: str) -> dict[str, Any] | None:
    """A `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block (Qwen's and Hermes'
    convention) as an OpenAI tool call with a fresh id; None when it does not parse."""
    match = _BLOCK.fullmatch(block.strip())
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _held(text: str, marks: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `marks`."""
    longest = 0
    for mark in marks:
        for k in range(min(len(mark) - 1, len(text)), longest, -1):
            if text.endswith(mark[:k]):
                longest = k
                break
    return longest


@dataclass
class AnswerText:
    """Feed it the sampled tokens (`push`), then the way the response ended (`finish`); each call
    returns what is new for the client: (text, tool calls)."""

    tokenizer: Any
    stops: Sequence[str] = ()
    tools: bool = False
    keep_stop: bool = False
    skip_special: bool = True
    tokens: list[int] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _pos: int = 0  # characters of the decoded text already released or parsed
    _text: str = ""  # the decoded text of whole characters so far
    _prefix: int = 0  # tokens[_prefix:_read] decode to the end of `_text` (context for the next)
    _read: int = 0

    def push(self, ids: Sequence[int]) -> tuple[str, list[dict[str, Any]]]:
        self.tokens += [int(t) for t in ids]
        self._decode(final=False)
        return self._release(self._text, final=False)

    def finish(self, finish_reason: str, stop: str | None) -> tuple[str, list[dict[str, Any]]]:
        self._decode(final=True)
        text = self._text
        if finish_reason == "stop" and stop and not self.keep_stop:
            cut = text.rfind(stop)
            if cut >= self._pos:  # OpenAI answers the text before the stop string
                text = text[:cut]
        return self._release(text, final=True)

    def _decode(self, *, final: bool) -> None:
        """Extend `_text` by the new tokens' text, decoding only a few tokens each step (a
        token's text can depend on the one before it, hence the window from `_prefix`). Half a
        UTF-8 character waits for the token that completes it, unless the answer is over."""
        decode = lambda ids: self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special)
        before = decode(self.tokens[self._prefix:self._read])
        now = decode(self.tokens[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self._text += now[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)

    @property
    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole answer's (content, tool calls), as a non-streamed reply gives them."""
        text = "".join(self.content)
        if self.calls:
            return text.strip() or None, self.calls
        return text, []

    def _release(self, text: str, *, final: bool) -> tuple[str, list[dict[str, Any]]]:
        out, calls = [], []
        while self._pos < len(text):
            rest = text[self._pos:]
            start = rest.find(OPEN) if self.tools else -1
            if start < 0:
                hold = 0 if final else _held(rest, [*self.stops, OPEN] if self.tools
                                             else self.stops)
                if not final:
                    # a whole stop string not yet cut by the engine (it ends the response)
                    hits = [rest.find(s) for s in self.stops if s in rest]
                    if hits and not self.keep_stop:
                        hold = max(hold, len(rest) - min(hits))
                take = len(rest) - hold
                out.append(rest[:take])
                self._pos += take
                break
            out.append(rest[:start])
            self._pos += start
            close = rest.find(CLOSE, start)
            if close < 0:
                if final:  # a block never closed stays text
                    out.append(rest[start:])
                    self._pos = len(text)
                break
            block = rest[start:close + len(CLOSE)]
            self._pos += len(block)
            call = parse_tool_call(block)
            if call is None:
                out.append(block)  # a block that does not parse stays text
            else:
                calls.append(call)
        new = "".join(out)
        if new:
            self.content.append(new)
        self.calls += calls
        return new, calls


def tool_call_deltas(calls: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """OpenAI's streaming form of whole tool calls: per call, a delta with its index, id, type and
    name (arguments empty), then one with its arguments."""
    out = []
    for k, call in enumerate(calls, start=first):
        fn = call["function"]
        out.append({"index": k, "id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": ""}})
        out.append({"index": k, "function": {"arguments": fn["arguments"]}})
    return out


def logprob_entries(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                    tops: Sequence[Sequence[tuple[int, float]]] | None,
                    top_n: int) -> list[dict[str, Any]]:
    """Chat `logprobs.content` entries: each token's text (an eos's too: it is the token, not
    content), logprob, bytes and its `top_n` most likely alternatives."""
    out = []
    for k, (t, lp) in enumerate(zip(ids, logprobs)):
        s = tokenizer.decode([int(t)])
        alts = []
        if top_n and tops is not None:
            for alt, alp in list(tops[k])[:top_n]:
                if not math.isfinite(alp):
                    continue  # outside top_k / top_p: the policy never samples it
                a = tokenizer.decode([int(alt)])
                alts.append({"token": a, "logprob": float(alp), "bytes": list(a.encode())})
        out.append({"token": s, "logprob": float(lp), "bytes": list(s.encode()),
                    "top_logprobs": alts})
    return out
