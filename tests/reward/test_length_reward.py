"""`length`: DAPO's overlong shaping and the length penalty by hand, and their named components
beside a correctness reward through the scorer (issue 28 item 3)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward.functions.length import LengthReward
from tandem.reward.scorer import LocalScorer


def score(response, **args):
    return LengthReward(RewardConfig()).score(ScoreItem(response=response, args=args))


@pytest.mark.parametrize("words, expected", [(5, 0.0), (6, 0.0), (8, -0.5), (10, -1.0),
                                             (12, -1.0)])
def test_overlong_shaping_follows_dapo(words, expected):
    # L_max 10, L_cache 4: 0 up to 6 words, then (6 - |y|) / 4, -1 past the cap
    s = score(" ".join(["w"] * words), max_length=10, buffer=4)
    assert s.score == pytest.approx(expected)
    assert s.components["overlong"] == pytest.approx(expected)
    assert s.components["size"] == words


def test_length_penalty_and_units(tiny_model_dir):
    s = score("abcdef", max_length=12, penalty=0.5, unit="chars")
    assert s.score == pytest.approx(-0.5 * 6 / 12) and s.components["penalty"] == s.score
    text = "12 34 56"
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(str(tiny_model_dir))(
        text, add_special_tokens=False)["input_ids"])
    s = score(text, max_length=n, buffer=n, unit="tokens", tokenizer=str(tiny_model_dir))
    assert s.components["size"] == n and s.score == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="args.max_length"):
        score("x")
    with pytest.raises(ValueError, match="unit tokens needs args.tokenizer"):
        score("x", max_length=4, unit="tokens")


def test_components_beside_a_correctness_reward():
    config = RewardConfig(functions={"k12": 1.0, "length": 1.0},
                          args={"length": {"max_length": 4, "buffer": 2}})

    async def run():
        scorer = LocalScorer(config=config)
        try:
            return await scorer.score([ScoreItem(response="the answer is 7", truth="7"),
                                       ScoreItem(response="7", truth="7")])
        finally:
            await scorer.close()

    long, short = asyncio.run(run())
    assert long.components["k12"] == 1.0 and short.components["k12"] == 1.0
    assert long.components["length"] == pytest.approx(-1.0)  # 4 words: at the cap
    assert long.components["length.overlong"] == pytest.approx(-1.0)
    assert short.components["length"] == 0.0
    assert long.score == pytest.approx(0.0) and short.score == pytest.approx(1.0)
