"""`length`: DAPO's overlong reward shaping and a linear length penalty as a reward component.

With |y| the response's length and L_max = `args.max_length`, L_cache = `args.buffer`:

    overlong = 0                                    |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
             = -1                                   |y| > L_max
    score    = overlong_penalty * overlong - penalty * |y| / L_max       (<= 0)

`args.unit` counts |y| in `tokens` (with `args.tokenizer`, a Hugging Face tokenizer folder,
usually the run's model.path), `chars` or `words` (whitespace-separated; the default). Weight it
beside a correctness reward, `reward.functions: {math: 1.0, length: 1.0}` with
`reward.args: {length: {max_length: 512, buffer: 128}}`; the score's components show
`length` (this score), `length.overlong`, `length.penalty` and `length.size`. The trainer's own
`trainer.length` shapes rewards the same way from token counts it already holds, and can also
mask truncated responses (docs/trainer.md "Length shaping").
"""

from __future__ import annotations

from functools import lru_cache

from tandem.common.messages.reward import Score, ScoreItem

from ..base import PureReward, register


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def overlong(size: float, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment, in [-1, 0]."""
    if size > max_length:
        return -1.0
    start = max_length - buffer
    return 0.0 if size <= start else (start - size) / buffer


def measure(text: str, unit: str, tokenizer: str | None) -> int:
    if unit == "tokens":
        if not tokenizer:
            raise ValueError("length: unit tokens needs args.tokenizer (a tokenizer folder)")
        return len(_tokenizer(tokenizer)(text, add_special_tokens=False)["input_ids"])
    if unit == "chars":
        return len(text)
    if unit == "words":
        return len(text.split())
    raise ValueError(f"length: unit {unit!r}; use tokens, chars or words")


@register("length")
class LengthReward(PureReward):
    """<= 0: the overlong shaping and length penalty of the response's length."""

    def score(self, item: ScoreItem) -> Score:
        args = item.args
        if "max_length" not in args:
            raise ValueError("length: set args.max_length (reward.args.length.max_length)")
        max_length, buffer = int(args["max_length"]), int(args.get("buffer", 0))
        if max_length < 1 or not 0 <= buffer <= max_length:
            raise ValueError(f"length: want max_length >= 1 and 0 <= buffer <= max_length, got "
                             f"max_length {max_length}, buffer {buffer}")
        size = measure(item.response, args.get("unit", "words"), args.get("tokenizer"))
        shaped = float(args.get("overlong_penalty", 1.0)) * overlong(size, max_length, buffer)
        penalty = float(args.get("penalty", 0.0)) * size / max_length
        reason = ("over the cap" if size > max_length else
                  "in the overlong buffer" if shaped < 0 else "within the length")
        return Score(score=shaped - penalty, reason=f"{size} {args.get('unit', 'words')}: {reason}",
                     components={"overlong": shaped, "penalty": -penalty, "size": float(size)})
