"""Text normalisation and answer extraction shared by the reward functions."""

from __future__ import annotations

import re
import unicodedata

MAX_RESPONSE_CHARS = 200_000  # longer responses are cut before any regex sees them


def fold_width(text: str) -> str:
    """Full-width ASCII forms and ideographic space to ASCII; any decimal digit to 0-9.

    Deliberately narrower than NFKC, which would also turn superscripts into digits (x² -> x2).
    """
    out = []
    for ch in text:
        code = ord(ch)
        if 0xFF01 <= code <= 0xFF5E:
            out.append(chr(code - 0xFEE0))
        elif ch == "\u3000":
            out.append(" ")
        elif code > 127 and unicodedata.category(ch) == "Nd":
            out.append(str(unicodedata.digit(ch)))
        else:
            out.append(ch)
    return "".join(out)


_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)[ \t]*\{|[{}]")


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if
    there is none or it is never closed. One pass with a stack: linear in the text, so 50 kB of
    unclosed `\\boxed{` costs what any 50 kB costs."""
    stack: list[tuple[bool, int]] = []  # (opens a box, where its content starts)
    best: tuple[int, int] | None = None
    for match in _BOX_TOKEN.finditer(text):
        token = match.group()
        if token == "}":
            if stack:
                is_box, start = stack.pop()
                if is_box and (best is None or start > best[0]):
                    best = (start, match.start())
        else:
            stack.append((token != "{", match.end()))
    return None if best is None else text[best[0]:best[1]]


def boxed_answers(text: str) -> list[str]:
    """Contents of every complete top-level `\\boxed{...}` in order (nested boxes belong to
    their outer one); linear like `last_boxed`."""
    stack: list[tuple[bool, int]] = []
    found: list[tuple[int, str]] = []
    for match in _BOX_TOKEN.finditer(text):
        token = match.group()
        if token == "}":
            if stack:
                is_box, start = stack.pop()
                if is_box and not any(b for b, _ in stack):
                    found.append((start, text[start:match.start()]))
        else:
            stack.append((token != "{", match.end()))
    return [content for _, content in sorted(found)]


def several_boxed(text: str) -> bool:
    """True when the response boxes two or more different answers: a hedge, never credited
    (one answer boxed twice is fine)."""
    return len({" ".join(b.split()) for b in boxed_answers(text)}) > 1


_LIST_ONLY = re.compile(r"[\s,;&]*(?:(?:or|and|either|and/or|或|和)[\s,;&]+)?")


def listed_numbers(text: str) -> int:
    """How many numbers `text` holds when it is nothing but numbers and list separators
    ("3, 4, 5", "3 or 4", "A, B"), else 0. Thousands separators keep "1,000" one number."""
    parts = re.split(r"((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)", " ".join(text.split()))
    numbers = parts[1::2]
    if len(numbers) < 2:
        return 0
    glue = parts[::2]
    if all(_LIST_ONLY.fullmatch(g.strip().lower() + (" " if g.strip() else "")) or not g.strip()
           for g in glue[1:-1]) and not glue[0].strip(" ([") and not glue[-1].strip(" .)]"):
        return len(set(numbers))
    return 0


def last_tagged(text: str, tag: str) -> str | None:
    """Content of the last `<tag>...</tag>` (case-insensitive), found from the end in linear
    time (a regex over many unclosed tags is quadratic)."""
    close = None
    for close in re.finditer(f"</{tag}>", text, re.IGNORECASE):
        pass
    if close is None:
        return None
    opening = None
    for opening in re.finditer(f"<{tag}>", text[:close.start()], re.IGNORECASE):
        pass
    return None if opening is None else text[opening.end():close.start()]


_ANSWER_LINE = re.compile(
    r"(?:final answer|answer)[ \t]*(?:is)?[ \t]*[:：]?[ \t]*(\S.*)", re.IGNORECASE)


def final_answer(text: str) -> str:
    """The part of a response that states the answer: <answer>...</answer>, the last \\boxed{},
    a line starting 'answer:' / 'the answer is', else the last non-empty line."""
    text = text[-MAX_RESPONSE_CHARS:]
    tagged = last_tagged(text, "answer")
    if tagged is not None:
        text = tagged
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    # whitespace runs folded to one space first: no regex below meets a long run
    lines = [" ".join(ln.split()) for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines[-50:]):
        match = _ANSWER_LINE.search(line)
        if match:
            return match.group(1).strip()
    return lines[-1] if lines else ""
