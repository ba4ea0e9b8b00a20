"""`format`: does the response have the required structure?

Patterns (`args.pattern`): `think_answer` (default) wants exactly
`<think>...</think>` then `<answer>...</answer>` and nothing around them; `boxed` wants a
complete `\\boxed{...}`; `answer` wants one `<answer>...</answer>`; any other string is a
regular expression the whole (stripped) response must match. Weight it against a correctness
reward in `reward.functions`, e.g. `{math: 1.0, format: 0.1}`.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tandem.common.messages.reward import Score, ScoreItem

from ..base import PureReward, register, result
from ..text import MAX_RESPONSE_CHARS, last_boxed

_THINK_ANSWER = re.compile(r"<think>(.+?)</think>\s*<answer>(.+?)</answer>", re.S)


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.S)
    except re.error as exc:
        raise ValueError(f"format pattern {pattern!r} is not a valid regular expression: {exc}")


@register("format")
class FormatReward(PureReward):
    """1.0 when the response has the required structure, else 0.0 with what is missing."""

    def score(self, item: ScoreItem) -> Score:
        text = item.response[-MAX_RESPONSE_CHARS:].strip()
        pattern = item.args.get("pattern", "think_answer")
        if pattern == "think_answer":
            return self._think_answer(text)
        if pattern == "boxed":
            ok = last_boxed(text) is not None
            return result(ok, "ok" if ok else "no complete \\boxed{...}", boxed=ok)
        if pattern == "answer":
            n = len(re.findall(r"<answer>.+?</answer>", text, re.S))
            return result(n == 1, "ok" if n == 1 else f"{n} <answer> blocks, want 1", answer=n == 1)
        ok = _compiled(pattern).fullmatch(text) is not None
        return result(ok, "ok" if ok else "does not match the pattern", match=ok)

    def _think_answer(self, text: str) -> Score:
        think = text.count("<think>") == 1 and text.count("</think>") == 1
        answer = text.count("<answer>") == 1 and text.count("</answer>") == 1
        ok = think and answer and _THINK_ANSWER.fullmatch(text) is not None
        if ok:
            reason = "ok"
        elif not think:
            reason = "want exactly one <think>...</think>"
        elif not answer:
            reason = "want exactly one <answer>...</answer>"
        else:
            reason = "want <think>...</think><answer>...</answer> and nothing around them"
        return result(ok, reason, think=think, answer=answer)
