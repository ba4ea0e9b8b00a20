"""`math`: is the response's final answer mathematically equal to the gold answer?

Equality is decided by math-verify (LaTeX and plain expressions, boxed answers, fractions
against decimals, sets, intervals, units in \\text{} stripped). Several different boxed
answers are a hedge and score 0; one boxed answer is the final answer. Parsing can take
unbounded time on pathological input, and math-verify's own limit is a SIGALRM that only works
on the main thread; so this function is `isolated`: the scorer runs it in a worker process and kills the
worker when it overruns `reward.timeout`.
"""

from __future__ import annotations

import threading
from typing import Any

from tandem.common.messages.reward import Score, ScoreItem

from ..base import PureReward, register, result
from ..text import MAX_RESPONSE_CHARS, fold_width, last_boxed, several_boxed


def _gold_text(truth: Any) -> str:
    if isinstance(truth, dict):
        truth = truth.get("answer")
    if truth is None or isinstance(truth, (list, tuple)):
        raise ValueError(f"math needs truth as an answer string or number, got {truth!r}")
    text = fold_width(str(truth).strip())
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


@register("math")
class MathReward(PureReward):
    """1.0 when the final answer equals the gold answer, else 0.0."""

    isolated = True

    def warm_up(self) -> None:
        # math-verify builds its LaTeX grammar on the first parse, not on import: 0.16 s of
        # CPU on 2 quiet cores, over 1 s on a loaded one, which a fresh worker's first item
        # would otherwise spend inside its time limit
        self.score(ScoreItem(fn=self.name or "math", response="\\boxed{\\frac{1}{2}}",
                             truth="0.5"))

    def score(self, item: ScoreItem) -> Score:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        # In a worker the parent's kill is the limit (and says `timeout`). Called directly,
        # math-verify's own SIGALRM limit is a safety net, on the main thread only.
        limit = max(1, int(self.config.timeout)) if not self.in_worker and (
            threading.current_thread() is threading.main_thread()) else None
        gold = parse(_gold_text(item.truth), parsing_timeout=limit)
        if not gold:
            return result(0.0, f"gold answer {item.truth!r} could not be parsed",
                          correct=0.0, parsed=0.0)
        response = fold_width(item.response[-MAX_RESPONSE_CHARS:])
        if several_boxed(response):
            return result(0.0, "hedged: several different boxed answers", correct=0.0,
                          parsed=0.0)
        boxed = last_boxed(response)
        if boxed is not None:  # the last box is the final answer; math-verify would join all
            response = f"\\boxed{{{boxed}}}"
        answer = parse(response, extraction_config=[
            LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
            parsing_timeout=limit)
        if not answer:
            return result(0.0, "no answer found", correct=0.0, parsed=0.0)
        if verify(gold, answer, timeout_seconds=limit):
            return result(1.0, "correct", correct=1.0, parsed=1.0)
        return result(0.0, f"wrong: got {answer[-1]!s:.60}, want {gold[-1]!s:.60}",
                      correct=0.0, parsed=1.0)
