"""k12, vision and format: tables of real cases, malformed input and unicode."""

from __future__ import annotations

import pytest

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward.functions.format import FormatReward
from tandem.reward.functions.k12 import K12Reward, normalise_text, parse_number
from tandem.reward.functions.vision import VisionReward, iou, parse_boxes


def _score(cls, response, truth=None, **args):
    return cls(RewardConfig()).score(ScoreItem(response=response, truth=truth, args=args))


K12 = [
    # multiple choice
    ("The answer is (B).", "B", True),
    ("B", "b", True),
    ("Answer: C", {"type": "choice", "answer": "B"}, False),
    ("答案：Ｂ", "B", True),
    ("I think it's between A and B", "B", False),
    # numbers with tolerance and units
    ("So the total is 1,200.", "1200", True),
    ("x = 3.14159", {"answer": 3.14, "tolerance": 1e-3}, True),
    ("x = 3.2", {"answer": 3.14, "tolerance": 1e-3}, False),
    ("The length is 12 cm", "12 cm", True),
    ("The length is 12 m", "12 cm", False),
    ("The length is 12", "12 cm", True),
    ("The length is 12", {"answer": "12 cm", "require_unit": True}, False),
    ("answer: -2/3", "-0.6666667", True),
    ("answer: −4", "-4", True),
    ("answer: ４２", "42", True),
    ("answer: 50%", "50%", True),
    ("answer: 1/0", "5", False),
    ("answer: 0.1", {"answer": "0", "abs_tolerance": 0.2}, True),
    # short answers
    ("The answer is: Photosynthesis!", "photosynthesis", True),
    ("The answer is the Pacific Ocean", "Pacific Ocean", True),
    ("Ｐａｃｉｆｉｃ　Ｏｃｅａｎ", "pacific ocean", True),
    ("Atlantic", {"answer": "Pacific", "aliases": ["the pacific ocean"]}, False),
    ("the pacific ocean", {"answer": "Pacific", "aliases": ["the pacific ocean"]}, True),
    ("<answer>Paris</answer> but maybe Lyon", "Paris", True),
    ("", "Paris", False),
]


@pytest.mark.parametrize("response,truth,correct", K12)
def test_k12_table(response, truth, correct):
    score = _score(K12Reward, response, truth)
    assert score.score == float(correct), score.reason


def test_k12_helpers():
    assert parse_number("3.5 cm") == (3.5, "cm")
    assert parse_number("1,234,567") == (1234567.0, "")
    assert parse_number("abc") is None
    assert normalise_text("  The  Great-Wall. ") == "greatwall"


def test_k12_bad_truth():
    with pytest.raises(ValueError, match="not one of choice"):
        _score(K12Reward, "x", {"type": "essay", "answer": "x"})
    with pytest.raises(ValueError, match="needs truth"):
        _score(K12Reward, "x", None)


VISION = [
    ('{"bbox_2d": [10, 10, 50, 50]}', {"box": [10, 10, 50, 50]}, 1.0),
    ("<box>(0,0),(10,10)</box>", {"box": [0, 0, 10, 20]}, 0.5),
    ("<|box_start|>(0,0),(10,10)<|box_end|>", {"box": [0, 0, 10, 10]}, 1.0),
    ("The cat is at [0, 0, 10, 10].", {"box": [20, 20, 30, 30]}, 0.0),
    ("at (0.0, 0.0, 0.5, 0.5)", {"box": [0, 0, 0.5, 1.0]}, 0.5),
    ("［0，0，10，10］".replace("，", ", "), {"box": [0, 0, 10, 10]}, 1.0),
    # malformed: x2 < x1, too few numbers, none at all
    ("[50, 50, 10, 10]", {"box": [10, 10, 50, 50]}, 0.0),
    ("[10, 10, 50]", {"box": [10, 10, 50, 50]}, 0.0),
    ("I cannot see it", {"box": [10, 10, 50, 50]}, 0.0),
    # several boxes: matched greedily; extra ones cost
    ("[0,0,10,10] [20,20,30,30]", {"boxes": [[0, 0, 10, 10], [20, 20, 30, 30]]}, 1.0),
    ("[0,0,10,10]", {"boxes": [[0, 0, 10, 10], [20, 20, 30, 30]]}, 0.5),
    ("[0,0,10,10] [20,20,30,30] [40,40,50,50]", {"boxes": [[0, 0, 10, 10]]}, 1 / 3),
    # point in box, counting
    ("It is at (15, 15).", {"point_in": [10, 10, 20, 20]}, 1.0),
    ("It is at (25, 15).", {"point_in": [10, 10, 20, 20]}, 0.0),
    ("There are 7 apples.", {"count": 7}, 1.0),
    ("There are ７ apples.", {"count": 7}, 1.0),
    ("I count 8", {"count": 7}, 0.0),
]


@pytest.mark.parametrize("response,truth,score", VISION)
def test_vision_table(response, truth, score):
    got = _score(VisionReward, response, truth)
    assert got.score == pytest.approx(score), got.reason


def test_vision_threshold_and_reasons():
    got = _score(VisionReward, "[0,0,10,10]", {"box": [0, 0, 10, 20]}, iou_threshold=0.5)
    assert got.score == 1.0 and got.components["iou"] == pytest.approx(0.5)
    malformed = _score(VisionReward, "[50, 50, 10, 10]", {"box": [10, 10, 50, 50]})
    assert malformed.reason == "1 malformed box(es), none usable"
    assert parse_boxes("[1,2,3,4] and (5,6),(7,8)") == ([(1, 2, 3, 4), (5, 6, 7, 8)], 0)
    assert iou((0, 0, 0, 0), (0, 0, 0, 0)) == 0.0
    with pytest.raises(ValueError, match="x2 < x1"):
        _score(VisionReward, "[0,0,1,1]", {"box": [5, 5, 1, 1]})


FORMAT = [
    ("<think>reasoning</think><answer>42</answer>", {}, True, "ok"),
    ("<think>a\nb</think>\n\n<answer>42</answer>\n", {}, True, "ok"),
    ("<answer>42</answer>", {}, False, "<think>"),
    ("<think>x</think>", {}, False, "<answer>"),
    ("<think>x</think><answer>1</answer><answer>2</answer>", {}, False, "<answer>"),
    ("<think>x</think><think>y</think><answer>1</answer>", {}, False, "<think>"),
    ("preamble <think>x</think><answer>1</answer>", {}, False, "nothing around"),
    ("<answer>1</answer><think>x</think>", {}, False, "nothing around"),
    ("so \\boxed{42}", {"pattern": "boxed"}, True, "ok"),
    ("so \\boxed{42", {"pattern": "boxed"}, False, "boxed"),
    ("<answer>١٢</answer>", {"pattern": "answer"}, True, "ok"),
    ("Final: 42", {"pattern": r"Final: \d+"}, True, "ok"),
    ("Final: forty", {"pattern": r"Final: \d+"}, False, "pattern"),
]


@pytest.mark.parametrize("response,args,ok,reason", FORMAT)
def test_format_table(response, args, ok, reason):
    got = _score(FormatReward, response, **args)
    assert got.score == float(ok) and reason in got.reason, got.reason


def test_format_bad_pattern_is_a_clear_error():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        _score(FormatReward, "x", pattern="(")
