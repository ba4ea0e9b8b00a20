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


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if
    there is none or it is never closed."""
    found = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_LINE = re.compile(
    r"(?:final answer|answer)\s*(?:is)?\s*[:：]?\s*(.+)", re.I)


def final_answer(text: str) -> str:
    """The part of a response that states the answer: <answer>...</answer>, the last \\boxed{},
    a line starting 'answer:' / 'the answer is', else the last non-empty line."""
    text = text[-MAX_RESPONSE_CHARS:]
    tags = _ANSWER_TAG.findall(text)
    if tags:
        text = tags[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        match = _ANSWER_LINE.search(line)
        if match:
            return match.group(1).strip()
    return lines[-1] if lines else ""
