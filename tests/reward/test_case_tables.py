"""The graders against the case tables in tests/reward/cases: ordinary answers, look-alikes,
hedges, units, LaTeX, non-ASCII digits and hostile inputs, each with the score a fair grader
gives, written down before the graders ran (cases/make_tables.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward.functions.format import FormatReward
from tandem.reward.functions.k12 import K12Reward
from tandem.reward.functions.vision import VisionReward
from tandem.reward.text import last_boxed

CASES = Path(__file__).parent / "cases"
GRADERS = {"k12": K12Reward, "format": FormatReward, "vision": VisionReward}


def _text(value) -> str:
    if isinstance(value, str):
        return value
    return value["prefix"] + value["repeat"] * value["times"] + value["suffix"]


def _rows(name: str) -> list[dict]:
    with open(CASES / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _label(row: dict) -> str:
    text = _text(row["response"])
    return (text[:40] + f"...({len(text)})") if len(text) > 40 else text


@pytest.mark.parametrize("name", sorted(GRADERS))
def test_every_case_scores_what_a_fair_grader_gives(name):
    grader = GRADERS[name](RewardConfig())
    rows = _rows(name)
    assert len(rows) >= 35
    wrong = []
    for row in rows:
        item = ScoreItem(fn=name, response=_text(row["response"]), truth=row.get("truth"),
                         args=row.get("args", {}))
        got = grader.score(item)
        if got.score != pytest.approx(row["score"], abs=1e-6):
            wrong.append((_label(row), row.get("truth"), row["score"], got.score, got.reason))
    assert not wrong, f"{len(wrong)} of {len(rows)} cases wrong:\n" + "\n".join(map(str, wrong))


def test_the_k12_table_is_hundreds_of_cases():
    rows = _rows("k12")
    assert len(rows) >= 300
    kinds = {row["kind"] for row in rows}
    assert {"choice", "number", "short", "hostile"} <= kinds


@pytest.mark.parametrize("name", sorted(GRADERS))
def test_hostile_cases_cost_linear_time(name):
    """50 kB of unclosed \\boxed{ or a 100 kB whitespace run took 9-10 s of CPU when the
    parsing was quadratic; every hostile row now takes about what reading it takes. The bound
    is generous (a quadratic parse of these inputs costs seconds, not tenths)."""
    grader = GRADERS[name](RewardConfig())
    long_rows = [r for r in _rows(name) if not isinstance(r["response"], str)]
    assert long_rows
    for row in long_rows:
        item = ScoreItem(fn=name, response=_text(row["response"]), truth=row.get("truth"),
                         args=row.get("args", {}))
        start = time.process_time()
        grader.score(item)
        assert time.process_time() - start < 1.0, _label(row)


def test_last_boxed_is_the_last_complete_box():
    assert last_boxed("\\boxed{1} then \\boxed{2}") == "2"
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\boxed{2") == "1"
    assert last_boxed("\\boxed{a \\boxed{b}}") == "b"
    assert last_boxed("\\boxed{" * 1000) is None
    assert last_boxed("}{ \\boxed{x}") == "x"
