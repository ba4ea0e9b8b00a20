"""`format`: does the response have the required structure?

Patterns (`args.pattern`): `think_answer` (default) wants exactly
`<think>...</think>` then `<answer>...</answer>` and nothing around them; `boxed` wants a
complete `\\boxed{...}` with something in it (and no other box holding a different
answer); `answer` wants one `<answer>...</answer>`; any other string is a regular expression the whole (stripped) response must match. The built-in
patterns read the whole response, however long, in linear time (tag counts and positions, no
backtracking regex), so a long response keeps its leading `<think>`. Weight it against a correctness
reward in `reward.functions`, e.g. `{math: 1.0, format: 0.1}`.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tandem.common.messages.reward import Score, ScoreItem

from ..base import PureReward, register, result
from ..text import MAX_RESPONSE_CHARS, last_boxed, several_boxed


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"format pattern {pattern!r} is not a valid regular expression: {exc}")


@register("format")
class FormatReward(PureReward):
    """1.0 when the response has the required structure, else 0.0 with what is missing."""

    isolated = True  # under the per-item time limit (a custom pattern may backtrack)

    def score(self, item: ScoreItem) -> Score:
        text = item.response.strip()
        pattern = item.args.get("pattern", "think_answer")
        if pattern == "think_answer":
            return self._think_answer(text)
        if pattern == "boxed":
            boxed = last_boxed(text)
            hedge = several_boxed(text)
            ok = boxed is not None and boxed.strip() != "" and not hedge
            why = "ok" if ok else ("several different boxed answers" if hedge else
                                   "empty \\boxed{}" if boxed is not None
                                   else "no complete \\boxed{...}")
            return result(ok, why, boxed=ok)
        if pattern == "answer":
            opens, closes = text.count("<answer>"), text.count("</answer>")
            ok = opens == 1 and closes == 1 and text.find("<answer>") < text.find("</answer>") \
                and text[text.find("<answer>") + 8:text.find("</answer>")].strip() != ""
            why = "ok" if ok else f"{opens} <answer> and {closes} </answer>, want one non-empty"
            return result(ok, why, answer=ok)
        # a user's regex: bounded input, and the worker's time limit for the rest
        ok = _compiled(pattern).fullmatch(text[-MAX_RESPONSE_CHARS:]) is not None
        return result(ok, "ok" if ok else "does not match the pattern", match=ok)

    def _think_answer(self, text: str) -> Score:
        think = text.count("<think>") == 1 and text.count("</think>") == 1
        answer = text.count("<answer>") == 1 and text.count("</answer>") == 1
        ok = False
        if think and answer and text.startswith("<think>") and text.endswith("</answer>"):
            t_end, a_start = text.find("</think>"), text.find("<answer>")
            ok = (7 < t_end < a_start and text[7:t_end].strip() != ""
                  and text[t_end + 8:a_start].strip() == ""
                  and text[a_start + 8:-9].strip() != "")
        if ok:
            reason = "ok"
        elif not think:
            reason = "want exactly one <think>...</think>"
        elif not answer:
            reason = "want exactly one <answer>...</answer>"
        else:
            reason = "want <think>...</think><answer>...</answer> and nothing around them"
        return result(ok, reason, think=think, answer=answer)
