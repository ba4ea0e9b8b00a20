"""`vision`: grounding rewards for vision-language responses.

`truth` says what is graded:
- `{"box": [x1, y1, x2, y2]}`: IoU of the first predicted box with it (score = IoU, or 1/0
  against `args.iou_threshold`);
- `{"boxes": [[...], ...]}`: predicted boxes matched greedily to gold ones by IoU, score = summed
  matched IoU / max(#gold, #predicted), so extra or missing boxes cost;
- `{"point_in": [x1, y1, x2, y2]}`: 1.0 when the predicted point lies in the box;
- `{"count": n}`: 1.0 when the stated count equals n.

Boxes are read from the usual formats: JSON (`{"bbox_2d": [...]}`, `{"bbox": [...]}`, a list of
4 numbers), Qwen-VL `<box>(x1,y1),(x2,y2)</box>` and `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`,
and plain `[x1, y1, x2, y2]` / `(x1, y1, x2, y2)`. A box with x2 < x1 or y2 < y1 is malformed
and ignored.
"""

from __future__ import annotations

import math
import re
from typing import Any

from tandem.common.messages.reward import Score, ScoreItem

from ..base import PureReward, register, result
from ..text import MAX_RESPONSE_CHARS, final_answer, fold_width, listed_numbers, several_boxed

_NUM = r"[-+]?\d+(?:\.\d+)?"
_PAIRS = re.compile(
    rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*,?\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)")
_QUAD = re.compile(rf"[\[\(]\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*[\]\)]")
_POINT = re.compile(rf"[\[\(]\s*({_NUM})\s*,\s*({_NUM})\s*[\]\)]")
_COUNT = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")

Box = tuple[float, float, float, float]


def _valid(box: Box) -> bool:
    return all(math.isfinite(v) for v in box) and box[2] >= box[0] and box[3] >= box[1]


def _plain(text: str) -> str:
    """Width folded and whitespace runs made one space, so no pattern meets a long run."""
    return " ".join(fold_width(text[:MAX_RESPONSE_CHARS]).split())


def parse_boxes(text: str) -> tuple[list[Box], int]:
    """(well-formed boxes in order of appearance, count of malformed ones)."""
    text = _plain(text)
    found: list[tuple[int, Box]] = []
    taken = []
    for match in _PAIRS.finditer(text):
        found.append((match.start(), tuple(float(g) for g in match.groups())))
        taken.append(match.span())
    for match in _QUAD.finditer(text):
        if not any(a <= match.start() < b for a, b in taken):
            found.append((match.start(), tuple(float(g) for g in match.groups())))
    boxes = [box for _, box in sorted(found, key=lambda f: f[0])]
    good = [b for b in boxes if _valid(b)]
    return good, len(boxes) - len(good)


def parse_point(text: str) -> tuple[float, float] | None:
    match = _POINT.search(_plain(text))
    return (float(match.group(1)), float(match.group(2))) if match else None


def iou(a: Box, b: Box) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _gold_box(value: Any, key: str) -> Box:
    if not (isinstance(value, (list, tuple)) and len(value) == 4):
        raise ValueError(f"vision truth {key!r} must be [x1, y1, x2, y2], got {value!r}")
    box = tuple(float(v) for v in value)
    if not _valid(box):
        raise ValueError(f"vision truth {key!r} {value!r} has x2 < x1 or y2 < y1")
    return box


@register("vision")
class VisionReward(PureReward):
    """IoU, point-in-box or count accuracy, by what `truth` holds."""

    isolated = True  # under the per-item time limit like every function, off the event loop

    def score(self, item: ScoreItem) -> Score:
        truth = item.truth if isinstance(item.truth, dict) else {}
        if "box" in truth:
            return self._one_box(item, _gold_box(truth["box"], "box"))
        if "boxes" in truth:
            return self._many_boxes(item, [_gold_box(b, "boxes") for b in truth["boxes"]])
        if "point_in" in truth:
            box = _gold_box(truth["point_in"], "point_in")
            point = parse_point(item.response)
            if point is None:
                return result(0.0, "no point found", inside=0.0)
            inside = box[0] <= point[0] <= box[2] and box[1] <= point[1] <= box[3]
            return result(inside, "inside" if inside else f"point {point} outside", inside=inside)
        if "count" in truth:
            want = int(truth["count"])
            said = _plain(final_answer(item.response))
            if listed_numbers(said) > 1 or several_boxed(item.response[-MAX_RESPONSE_CHARS:]):
                return result(0.0, f"hedged: a list of counts {said[:60]!r}", correct=0.0)
            match = _COUNT.findall(said)
            if not match:
                return result(0.0, "no count found", correct=0.0)
            value = float(match[-1].replace(",", ""))  # "1,000" is a thousand, "4.5" is 4.5
            if not value.is_integer():
                return result(0.0, f"count {match[-1]} is not a whole number", correct=0.0,
                              error=abs(value - want))
            got = int(value)
            ok = got == want
            return result(ok, "correct" if ok else f"counted {got}, want {want}", correct=ok,
                          error=abs(got - want))
        raise ValueError(
            f"vision truth must hold box, boxes, point_in or count; got {item.truth!r}")

    def _one_box(self, item: ScoreItem, gold: Box) -> Score:
        boxes, malformed = parse_boxes(item.response)
        if not boxes:
            reason = f"{malformed} malformed box(es), none usable" if malformed else "no box found"
            return result(0.0, reason, iou=0.0)
        overlap = iou(boxes[0], gold)
        threshold = item.args.get("iou_threshold")
        score = overlap if threshold is None else float(overlap >= float(threshold))
        return result(score, f"iou {overlap:.3f}", iou=overlap)

    def _many_boxes(self, item: ScoreItem, gold: list[Box]) -> Score:
        boxes, malformed = parse_boxes(item.response)
        pairs = sorted(((iou(p, g), i, j) for i, p in enumerate(boxes) for j, g in enumerate(gold)),
                       reverse=True)
        used_p, used_g, total = set(), set(), 0.0
        for overlap, i, j in pairs:
            if overlap > 0 and i not in used_p and j not in used_g:
                used_p.add(i)
                used_g.add(j)
                total += overlap
        if not gold and not boxes:  # nothing to find, and nothing claimed: right
            return result(1.0, "no gold boxes and none predicted", matched=0, predicted=0,
                          mean_iou=1.0)
        denom = max(len(gold), len(boxes))
        score = total / denom
        return result(score, f"{len(used_g)}/{len(gold)} gold boxes matched, {len(boxes)} "
                             f"predicted, {malformed} malformed", matched=len(used_g),
                      predicted=len(boxes), mean_iou=score)
