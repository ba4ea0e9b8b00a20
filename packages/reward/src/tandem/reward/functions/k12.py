"""`k12`: school-style answers: multiple choice, numbers with tolerance and units, short text.

The kind comes from `truth` (`{"type": "choice" | "number" | "short", "answer": ...}`) or is
guessed from a bare answer: a single letter A-J is a choice, something that reads as a number
is a number, anything else short text. Numbers compare with `tolerance` (relative, default
1e-6; `abs_tolerance` absolute); a unit in the gold answer must match when the response gives
one (`require_unit: true` makes it mandatory). Short answers compare after folding case,
punctuation, whitespace and full-width characters; `aliases` lists other accepted answers.

How answers are read (docs/reward.md has the table of choices):
- a choice is a letter standing as an option: `B`, `(B)`, `B.`, `B)`, `B:`, `B,`, `**B**`,
  `\\boxed{B}`, "the answer is B", "option B"; the pronoun "I" and the article "A" in a sentence
  ("I think", "A triangle") are words, not options; naming several options ("(B) or (C)",
  "A, B, C, D") is a hedge and scores 0;
- so are several different boxed answers and a bare list of numbers ("3, 4, 5", "3 or 4");
- a number may be LaTeX (`\\frac{3}{4}`, `\\dfrac`, `$...$`, `\\boxed{}`, `\\text{cm}`,
  `\\times 10^{3}`), a fraction, a decimal, with thousands separators, a percent sign, or any
  Unicode decimal digits; in "3 + 4 = 7" the answer is what follows the last `=`; the unit is
  the word right after the number ("12 cm (6 cm + 6 cm)" has unit cm), with common spellings
  folded (centimeters -> cm, cm² -> cm^2, degrees -> °).
"""

from __future__ import annotations

import math
import re
import string
from typing import Any

from tandem.common.messages.reward import Score, ScoreItem

from ..base import PureReward, register, result
from ..text import final_answer, fold_width, listed_numbers, several_boxed

MAX_ANSWER_CHARS = 2000  # a stated answer longer than this is not a letter or a number

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(rf"([-+]?)({_NUM})(?:[eE]([-+]?\d+))?")
_SCI = re.compile(r"^(?:\*|x|×|\\times|\\cdot)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?")
_UNIT = re.compile(r"^(%|°[CF]?|(?:(?:square|sq\.?|cubic|cu\.?) )?"
                   r"[A-Za-zµΩ\u4e00-\u9fff][A-Za-zµΩ\u4e00-\u9fff]*"
                   r"(?:\s*(?:\^\s*\{?\d\}?|[²³]))?(?:\s*/\s*[A-Za-z]+(?:\^\d|[²³])?)?)")
_PUNCT = str.maketrans("", "", string.punctuation + "。，、；：？！「」『』（）【】")
_UNIT_NAMES = {
    "percent": "%", "per cent": "%", "degrees": "°", "degree": "°", "deg": "°",
    "meters": "m", "meter": "m", "metres": "m", "metre": "m",
    "centimeters": "cm", "centimeter": "cm", "centimetres": "cm", "centimetre": "cm",
    "millimeters": "mm", "millimeter": "mm", "kilometers": "km", "kilometer": "km",
    "grams": "g", "gram": "g", "kilograms": "kg", "kilogram": "kg",
    "seconds": "s", "second": "s", "sec": "s", "minutes": "min", "minute": "min",
    "hours": "h", "hour": "h", "hr": "h", "liters": "l", "liter": "l", "litres": "l",
    "litre": "l", "milliliters": "ml", "milliliter": "ml",
}
_WORD_AFTER = {"I", "A"}  # letters that are also English words
_OPTION_VERBS = {"or", "and", "is", "was", "seems", "looks", "fits", "matches", "nor"}


def normalise_text(text: str) -> str:
    """Fold width, case, punctuation and whitespace; drop leading articles."""
    text = fold_width(text).lower().translate(_PUNCT)
    words = text.split()
    if words and words[0] in ("a", "an", "the"):
        words = words[1:]
    return " ".join(words)


def _unlatex(text: str) -> str:
    """Plain text from the LaTeX a number is usually written in."""
    text = text.replace("\\$", "$")
    for cmd in ("\\left", "\\right", "\\,", "\\!", "\\;", "\\:", "\\displaystyle", "\\ "):
        text = text.replace(cmd, " " if cmd == "\\ " else "")
    text = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", text)
    text = re.sub(r"\\[dt]?frac\s*(\d)\s*(\d)", r"\1/\2", text)  # \frac12
    text = re.sub(r"\\(?:text|mathrm|textrm|mbox|operatorname)\s*\{([^{}]*)\}", r" \1", text)
    text = re.sub(r"\^\s*\{\\circ\}|\^\s*\\circ|\\circ|\\degree", "°", text)
    text = text.replace("\\%", "%").replace("\\pi", "π")
    text = re.sub(r"\\boxed\s*\{([^{}]*)\}", r"\1", text)
    text = text.replace("$", " ").replace("\\(", " ").replace("\\)", " ")
    text = text.replace("\\[", " ").replace("\\]", " ")
    return text


def _unit(text: str) -> str:
    unit = text.strip().lower()
    unit = re.sub(r"\s+", " ", unit).replace("²", "^2").replace("³", "^3")
    unit = re.sub(r"\^\s*\{?(\d)\}?", r"^\1", unit).replace(" ^", "^")
    unit = re.sub(r"^(?:square|sq\.?) (\w+)$", r"\1^2", unit)
    unit = re.sub(r"^(?:cubic|cu\.?) (\w+)$", r"\1^3", unit)
    base, _, power = unit.partition("^")
    base = _UNIT_NAMES.get(base, base)
    return f"{base}^{power}" if power else base


def parse_number(text: str) -> tuple[float, str] | None:
    """(value, unit) when `text` is one number with at most a unit after it: '3.5 cm',
    '1,200', '-2/3', '\\frac{3}{4}', '45%', '1.2 \\times 10^{3}'; None otherwise."""
    text = " ".join(_unlatex(fold_width(text[:MAX_ANSWER_CHARS])).split())
    text = text.replace("−", "-").replace("–", "-").strip().rstrip(".").strip()
    frac = re.fullmatch(r"\(?\s*([-+]?\d+)\s*\)?\s*/\s*\(?\s*(\d+)\s*\)?\s*(.*)", text)
    sign_frac = re.fullmatch(r"-\s*\(\s*(\d+)\s*\)\s*/\s*\(\s*(\d+)\s*\)\s*(.*)", text)
    if sign_frac:
        frac = sign_frac
    if frac and max(len(frac.group(1)), len(frac.group(2))) > 300:
        return None  # no school answer has 300 digits; int() would refuse past 4300 anyway
    if frac:
        den = int(frac.group(2))
        if den == 0:
            return None
        num = int(frac.group(1)) * (-1 if sign_frac else 1)
        unit = _unit_of(frac.group(3))
        return (num / den, unit) if unit is not None else None
    match = _NUMBER.match(text)
    if not match:
        return None
    try:
        value = float(match.group(1) + match.group(2).replace(",", ""))
    except ValueError:
        return None
    if match.group(3):
        value = _scaled(value, match.group(3))
    rest = text[match.end():].strip()
    sci = _SCI.match(rest)
    if sci:
        value = _scaled(value, sci.group(1))
        rest = rest[sci.end():].strip()
    if not math.isfinite(value):
        return None
    unit = _unit_of(rest)
    return (value, unit) if unit is not None else None


def _scaled(value: float, exponent: str) -> float:
    """value × 10^exponent, inf or 0 past float's range instead of OverflowError."""
    if len(exponent.lstrip("+-")) > 4:
        return math.inf if not exponent.startswith("-") else 0.0
    return float(f"{value!r}e{int(exponent)}") if "e" not in repr(value) else \
        value * 10.0 ** max(-400, min(400, int(exponent)))


def _unit_of(rest: str) -> str | None:
    """The unit a number's remainder names: '' for nothing, None when the remainder is not a
    unit (more numbers, an operator: then this was not one number)."""
    rest = rest.strip()
    if not rest:
        return ""
    match = _UNIT.match(rest)
    if not match:
        return None
    tail = rest[match.end():].strip()
    # "12 cm (6 cm + 6 cm)" keeps its unit; "12 apples and 3 pears" is not one number
    if (tail and not tail.startswith(("(", "["))
            and (re.search(r"\d", tail) or tail[:1] in "+*/=<>^")):
        return None
    return _unit(match.group(1))


def _after_equals(text: str) -> str:
    """'3 + 4 = 7' -> '7': a worked line states its result after the last '='."""
    if "=" in text:
        return text.rsplit("=", 1)[1]
    return text


def _strip_choice_words(text: str) -> str:
    text = re.sub(r"\*\*|__|`", "", text)
    text = _unlatex(text)
    text = re.sub(r"^(?:(?:so|thus|therefore|hence)[, ]+)?(?:the\s+)?"
                  r"(?:correct\s+|final\s+|right\s+)?(?:answer|option|choice)\s*(?:is|would be|:|：)?\s*[:：]?\s*"
                  r"|^答案\s*(?:是|为)?\s*[:：]?\s*|^选\s*", "", text.strip(), flags=re.IGNORECASE)
    return text.strip()


_OPTION = re.compile(r"(?<![A-Za-z'’])(\(([A-J])\)|\[([A-J])\]|([A-J]))(?![A-Za-z'’])")


def read_choice(text: str) -> tuple[str | None, str]:
    """(letter, why): the option `text` states, or None with 'hedged' / 'no option'."""
    text = _strip_choice_words(fold_width(text[:MAX_ANSWER_CHARS]))
    alone = re.fullmatch(r"[(\[]?([a-jA-J])[)\]]?[.):,]?", text)
    if alone:  # a lone letter, any case: "b", "(c)"
        return alone.group(1).upper(), ""
    found = []
    for match in _OPTION.finditer(text):
        letter = match.group(2) or match.group(3) or match.group(4)
        bare = match.group(4) is not None
        after = re.match(r" ([a-z]+)", text[match.end():match.end() + 12])
        if bare and letter in _WORD_AFTER and after and after.group(1) not in _OPTION_VERBS:
            continue  # "I think", "A triangle": words; "A is correct", "A or B": options
        found.append((match.start(), letter))
    if not found:
        return None, "no option"
    letters = {letter for _, letter in found}
    if len(letters) == 1:
        return found[0][1], ""
    first_pos, first = found[0]
    if first_pos == 0:
        # "B. because A is wrong" names B; "A, B" / "(B) or (C)" hedge
        nxt = found[1][0]
        between = text[_end_of_option(text):nxt]
        if re.fullmatch(r"[\s,;/&]*(?:or|and|及|或|和)?[\s,;/&]*", between, re.IGNORECASE):
            return None, "hedged: several options"
        return first, ""
    return None, "hedged: several options"


def _end_of_option(text: str) -> int:
    match = _OPTION.match(text)
    return match.end() if match else 0


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

    isolated = True  # under the per-item time limit like every function, off the event loop

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
        if several_boxed(item.response[-200_000:]):
            return result(0.0, "hedged: several different boxed answers", correct=0.0)
        if kind == "choice":
            want = str(spec["answer"]).strip().strip("()").upper()
            got, why = read_choice(said)
            ok = got is not None and got == want
            if ok:
                return result(1.0, "correct", correct=1.0)
            return result(0.0, f"wrong: {why or f'chose {got}'}, want {want}", correct=0.0)
        if kind == "number":
            return self._number(said, spec)
        if kind == "short":
            accepted = [spec["answer"], *spec.get("aliases", [])]
            got = normalise_text(said[:MAX_ANSWER_CHARS])
            ok = any(got == normalise_text(str(a)) for a in accepted)
            return result(ok, "correct" if ok else f"wrong: got {got[:60]!r}", correct=ok)
        raise ValueError(f"k12 truth type {kind!r} is not one of choice, number, short")

    @staticmethod
    def _stated_number(said: str) -> tuple[float, str] | None:
        """The number a stated answer gives: the whole of it, the part after its last '=',
        or the last number of its last sentence ('so the total is 1,200.')."""
        said = said[:MAX_ANSWER_CHARS]
        for text in (said, _after_equals(_unlatex(said))):
            parsed = parse_number(text)
            if parsed is not None:
                return parsed
        plain = " ".join(_unlatex(fold_width(said)).replace("−", "-").split())
        plain = _after_equals(plain)
        last = None
        for match in _NUMBER.finditer(plain):
            last = match
        if last is None:
            return None
        # from the last number on, re-read as "number [unit]"
        start = last.start()
        frac = re.search(r"[-+]?\(?\d+\)?\s*/\s*\(?\d+\)?\s*$", plain[:last.end()])
        if frac:
            start = frac.start()
        tail = plain[start:]
        unit = _UNIT.match(tail[last.end() - start:].strip())
        text = tail[:last.end() - start] + (" " + unit.group(1) if unit else "")
        return parse_number(text)

    def _number(self, said: str, spec: dict) -> Score:
        want = parse_number(str(spec["answer"]))
        if want is None:
            raise ValueError(f"k12 gold answer {spec['answer']!r} is not a number")
        if listed_numbers(fold_width(said[:MAX_ANSWER_CHARS])) > 1:
            return result(0.0, f"hedged: a list of numbers {said[:60]!r}", correct=0.0)
        got = self._stated_number(said)
        if got is None:
            return result(0.0, f"not a number: {said[:60]!r}", correct=0.0)
        (gv, gu), (wv, wu) = got, want
        rel = float(spec.get("tolerance", 1e-6))
        abs_tol = float(spec.get("abs_tolerance", 0.0))
        close = math.isclose(gv, wv, rel_tol=rel, abs_tol=abs_tol)
        unit = _unit(str(spec.get("unit", wu)))
        if gu and unit and gu != unit:
            return result(0.0, f"wrong unit: {gu!r}, want {unit!r}", correct=0.0, value=close)
        if spec.get("require_unit") and unit and not gu:
            return result(0.0, f"missing unit {unit!r}", correct=0.0, value=close)
        return result(close, "correct" if close else f"wrong: {gv:g}, want {wv:g}",
                      correct=close, value=close)
