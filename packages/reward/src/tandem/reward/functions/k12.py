"""`k12`: school-style answers: multiple choice, numbers with tolerance and units, short text.

The kind comes from `truth` (`{"type": "choice" | "number" | "short", "answer": ...}`) or is
guessed from a bare answer: a single letter A-J is a choice, something that reads as a number
is a number, anything else short text. Numbers compare with `tolerance` (relative, default
1e-6; `abs_tolerance` absolute); a unit in the gold answer must match when the response gives
one (`require_unit: true` makes it mandatory). Short answers compare after folding case,
punctuation, whitespace and full-width characters; `aliases` lists other accepted answers.
"""

from __future__ import annotations

import math
import re
import string
from typing import Any

from tandem.common.messages.reward import Score, ScoreItem

from ..base import PureReward, register, result
from ..text import final_answer, fold_width

_NUMBER = re.compile(
    r"^\s*([-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+−]?\.\d+)"
    r"\s*(%|[^\d\s].*?)?\s*$")
_FRACTION = re.compile(r"^\s*([-+−]?\d+)\s*/\s*(\d+)\s*(.*?)\s*$")
_CHOICE = re.compile(r"^\(?([A-Ja-j])\)?(?:[.):]|\s|$)")
_NUMBER_IN_TEXT = re.compile(
    r"([-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?)"
    r"(?:\s*(%|[A-Za-zµ°]+\b))?")
_PUNCT = str.maketrans("", "", string.punctuation + "。，、；：？！「」『』（）【】")


def normalise_text(text: str) -> str:
    """Fold width, case, punctuation and whitespace; drop leading articles."""
    text = fold_width(text).lower().translate(_PUNCT)
    words = text.split()
    if words and words[0] in ("a", "an", "the"):
        words = words[1:]
    return " ".join(words)


def parse_number(text: str) -> tuple[float, str] | None:
    """(value, unit) from '3.5 cm', '1,200', '-2/3', '45%'; None when it is not a number."""
    text = fold_width(text).replace("−", "-").strip().rstrip(".")
    text = re.sub(r"^\$|\$$", "", text).strip()
    frac = _FRACTION.match(text)
    if frac:
        den = int(frac.group(2))
        if den == 0:
            return None
        return int(frac.group(1)) / den, frac.group(3).strip().lower()
    match = _NUMBER.match(text)
    if not match:
        return None
    try:
        value = float(match.group(1).replace(",", "").replace("−", "-"))
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return value, (match.group(2) or "").strip().lower().rstrip(".")


def _choice(text: str) -> str | None:
    text = fold_width(text).strip()
    text = re.sub(r"^(?:(?:the\s+)?(?:correct\s+)?(?:answer|option|choice)\s*(?:is)?"
                  r"|答案(?:是|为)?|选)\s*[:：]?\s*", "", text, flags=re.I)
    match = _CHOICE.match(text)
    return match.group(1).upper() if match else None


def _kind(answer: Any) -> str:
    if isinstance(answer, (int, float)):
        return "number"
    text = str(answer).strip()
    if re.fullmatch(r"\(?[A-Ja-j]\)?", text):
        return "choice"
    return "number" if parse_number(text) is not None else "short"


@register("k12")
class K12Reward(PureReward):
    """1.0 for a matching choice letter, number (within tolerance, same unit) or short answer."""

    def score(self, item: ScoreItem) -> Score:
        truth = item.truth if isinstance(item.truth, dict) else {"answer": item.truth}
        if truth.get("answer") is None:
            raise ValueError(
                f"k12 needs truth as an answer or {{'answer': ...}}, got {item.truth!r}")
        spec = {**item.args, **truth}
        kind = spec.get("type") or _kind(spec["answer"])
        said = final_answer(item.response)
        if not said:
            return result(0.0, "no answer found", correct=0.0)
        if kind == "choice":
            got, want = _choice(said), _choice(str(spec["answer"]))
            ok = got is not None and got == want
            return result(ok, "correct" if ok else f"wrong: chose {got}, want {want}", correct=ok)
        if kind == "number":
            return self._number(said, spec)
        if kind == "short":
            accepted = [spec["answer"], *spec.get("aliases", [])]
            got = normalise_text(said)
            ok = any(got == normalise_text(str(a)) for a in accepted)
            return result(ok, "correct" if ok else f"wrong: got {got[:60]!r}", correct=ok)
        raise ValueError(f"k12 truth type {kind!r} is not one of choice, number, short")

    @staticmethod
    def _last_number(text: str) -> tuple[float, str] | None:
        """The last number in a sentence ('so the total is 1,200.'), with the word after it."""
        matches = list(_NUMBER_IN_TEXT.finditer(fold_width(text).replace("−", "-")))
        for match in reversed(matches):
            parsed = parse_number(f"{match.group(1)} {match.group(2) or ''}")
            if parsed is not None:
                return parsed
        return None

    def _number(self, said: str, spec: dict) -> Score:
        want = parse_number(str(spec["answer"]))
        if want is None:
            raise ValueError(f"k12 gold answer {spec['answer']!r} is not a number")
        got = parse_number(said) or self._last_number(said)
        if got is None:
            return result(0.0, f"not a number: {said[:60]!r}", correct=0.0)
        (gv, gu), (wv, wu) = got, want
        rel = float(spec.get("tolerance", 1e-6))
        abs_tol = float(spec.get("abs_tolerance", 0.0))
        close = math.isclose(gv, wv, rel_tol=rel, abs_tol=abs_tol)
        unit = str(spec.get("unit", wu)).lower()
        if gu and unit and gu != unit:
            return result(0.0, f"wrong unit: {gu!r}, want {unit!r}", correct=0.0, value=close)
        if spec.get("require_unit") and unit and not gu:
            return result(0.0, f"missing unit {unit!r}", correct=0.0, value=close)
        return result(close, "correct" if close else f"wrong: {gv:g}, want {wv:g}",
                      correct=close, value=close)
