"""Property tests of the parsers every reward function relies on: any text, no crash, and
what they return keeps its promises."""

from __future__ import annotations

import re
import subprocess
import sys

from backstop import BACKSTOP
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward.functions.format import FormatReward
from tandem.reward.functions.k12 import K12Reward
from tandem.reward.functions.vision import VisionReward, iou, parse_boxes
from tandem.reward.text import final_answer, fold_width, last_boxed

SYMBOLS = list("\\boxed{}()[],. 0123456789-+/abcAB<>:answer１２Ｂ，　١٢\n")
TEXT = st.text(alphabet=st.sampled_from(SYMBOLS), max_size=80) | st.text(max_size=80)


@settings(deadline=None)
@given(TEXT)
def test_last_boxed_returns_balanced_content(text):
    found = last_boxed(text)
    if found is not None:
        assert found.count("{") == found.count("}")
        assert re.search(r"\\(?:boxed|fbox)\s*\{" + re.escape(found) + r"\}", text)


@settings(deadline=None)
@given(TEXT)
def test_fold_width_is_idempotent_and_ascii_digits(text):
    once = fold_width(text)
    assert fold_width(once) == once
    assert not any(ch.isdecimal() and not ch.isascii() for ch in once)


@settings(deadline=None)
@given(TEXT)
def test_boxes_parsed_from_any_text_are_well_formed(text):
    boxes, malformed = parse_boxes(text)
    assert malformed >= 0
    for box in boxes:
        assert box[2] >= box[0] and box[3] >= box[1]
        assert 0.0 <= iou(box, box) <= 1.0


@settings(max_examples=60, deadline=None)
@given(TEXT, st.one_of(st.just("B"), st.just("12 cm"), st.just("-2/3"), st.just("Paris")))
def test_k12_scores_any_response_in_range(response, truth):
    score = K12Reward(RewardConfig()).score(ScoreItem(response=response, truth=truth))
    assert score.score in (0.0, 1.0) and score.reason
    assert isinstance(final_answer(response), str)


@settings(max_examples=60, deadline=None)
@given(TEXT, st.sampled_from(["think_answer", "boxed", "answer"]))
def test_format_scores_any_response(response, pattern):
    score = FormatReward(RewardConfig()).score(
        ScoreItem(response=response, args={"pattern": pattern}))
    assert score.score in (0.0, 1.0) and score.reason


@settings(max_examples=60, deadline=None)
@given(TEXT)
def test_vision_iou_stays_in_range(response):
    score = VisionReward(RewardConfig()).score(
        ScoreItem(response=response, truth={"box": [0, 0, 10, 10]}))
    assert 0.0 <= score.score <= 1.0


def test_cli_help_is_instant_and_imports_no_model_code():
    code = ("import sys; from tandem.reward.cli import main; "
            "print('torch' in sys.modules, 'transformers' in sys.modules, "
            "'math_verify' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=BACKSTOP)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr
