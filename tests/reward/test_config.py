"""The `reward` config section: defaults, constraints and messages that say how to fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward import LocalScorer


def test_defaults_are_valid():
    config = RewardConfig()
    assert config.functions == {"math": 1.0} and config.code.memory_mb == 512


@pytest.mark.parametrize("fields,message", [
    ({"functions": {}}, "name at least one reward function"),
    ({"functions": {"math": float("nan")}}, "finite"),
    ({"functions": {"reward_model": 1.0}}, "reward.reward_model.path"),
    ({"timeout": 30, "request_timeout": 10}, "raise request_timeout"),
    ({"workers": 0}, "greater than or equal to 1"),
    ({"code": {"memory_mb": 8}}, "greater than or equal to 64"),
    ({"code": {"isolation": "docker"}}, "'auto', 'namespaces' or 'none'"),
    ({"unknown": 1}, "Extra inputs"),
])
def test_bad_values_are_explained(fields, message):
    with pytest.raises(ValidationError, match=message):
        RewardConfig(**fields)


def test_unknown_function_fails_when_the_scorer_is_built():
    with pytest.raises(KeyError, match="unknown reward function 'maths'"):
        LocalScorer(functions={"maths": 1.0})


def test_score_item_takes_one_selector():
    with pytest.raises(ValidationError, match="either fn or functions"):
        ScoreItem(fn="math", functions={"math": 1.0}, response="x")
    with pytest.raises(ValidationError, match="functions is empty"):
        ScoreItem(functions={}, response="x")
