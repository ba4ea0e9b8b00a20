"""reward_model: a tiny Qwen2ForSequenceClassification built here scores pairs in batches."""

from __future__ import annotations

import asyncio

import pytest
from backstop import BACKSTOP

from tandem.common.config.reward import RewardConfig, RewardModelConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward import LocalScorer


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from tandem.weights.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tiny-reward-model")
    tokenizer = build_tokenizer(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        num_labels=1, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(str(path))
    return path


def _reference(path, texts):
    """One text at a time (no padding), straight through transformers, from the same folder,
    with the character tokenizer as it was built (spaces are tokens)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from tandem.weights.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.inference_mode():
        return [model(**tokenizer([t], return_tensors="pt")).logits[0, 0].item() for t in texts]


async def test_scores_match_a_direct_forward_pass_and_are_batched(tiny_reward_model):
    path = tiny_reward_model
    config = RewardConfig(functions={"reward_model": 1.0}, timeout=BACKSTOP,
                          request_timeout=BACKSTOP,
                          reward_model=RewardModelConfig(path=str(path), batch_size=4, linger=0.05))
    pairs = [("What is 2+2? ", "4"), ("Say hi. ", "hello there"), ("Q: ", "a much longer answer"),
             ("x", "y"), ("Name a color. ", "blue"), ("1+1=", "2")]
    async with LocalScorer(config=config) as scorer:
        scores = await scorer.score([ScoreItem(prompt=p, response=r) for p, r in pairs])
        fn = scorer._functions["reward_model"]
        assert fn.batches == 2  # six pairs in batches of four
    wants = _reference(path, [p + r for p, r in pairs])
    for want, score in zip(wants, scores):
        assert score.score == pytest.approx(want, abs=1e-4), score.reason
        assert score.components["reward_model.logit"] == pytest.approx(want, abs=1e-4)
    assert len({round(s.score, 6) for s in scores}) > 1  # a real model, not a constant


async def test_sigmoid_and_concurrent_callers_share_batches(tiny_reward_model):
    path = tiny_reward_model
    config = RewardConfig(
        functions={"reward_model": 1.0}, timeout=BACKSTOP, request_timeout=BACKSTOP,
        reward_model=RewardModelConfig(path=str(path), batch_size=8, linger=0.05,
                                       normalize="sigmoid"))
    async with LocalScorer(config=config) as scorer:
        results = await asyncio.gather(*(
            scorer.score([ScoreItem(prompt="p", response=f"answer {i}")]) for i in range(8)))
        assert scorer._functions["reward_model"].batches == 1
    assert all(0.0 < r[0].score < 1.0 for r in results)


async def test_a_missing_model_is_an_error_score_not_a_crash(tmp_path):
    config = RewardConfig(functions={"reward_model": 1.0},
                          reward_model=RewardModelConfig(path=str(tmp_path / "nope")))
    async with LocalScorer(config=config) as scorer:
        [score] = await scorer.score([ScoreItem(response="x")])
    assert score.score == 0.0 and score.reason.startswith("error:")
    assert scorer.stats["reward_model"]["errors"] == 1
