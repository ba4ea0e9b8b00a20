"""math: real answers, answers that look equal but are not, malformed boxes, unicode, and a
pathological expression that must be killed by the worker pool's time limit."""

from __future__ import annotations

import time

import pytest
from backstop import BACKSTOP
from processes import cpu_seconds

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward import LocalScorer
from tandem.reward.functions.math_answer import MathReward

CASES = [
    # (response, gold, correct)
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", True),
    ("so we get $\\frac{2}{4}$", "\\frac{1}{2}", True),
    ("\\boxed{3.0}", "3", True),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", True),
    ("\\boxed{(0,1]}", "(0,1]", True),
    ("\\boxed{10\\text{ cm}}", "10", True),
    ("\\boxed{x\\cdot x}", "x^2", True),
    ("\\boxed{\\pi}", "\\pi", True),
    ("\\boxed{1000}", "1,000", True),
    # several different boxed answers are a hedge (a policy would learn to box every guess)
    ("first \\boxed{7}, finally \\boxed{8}", "8", False),
    ("\\boxed{8}, that is \\boxed{ 8 }", "8", True),
    ("\\boxed{\\boxed{6}}", "6", True),
    ("\\boxed{\\dfrac{3}{4}}", {"answer": "0.75"}, True),
    ("answer: 12", 12, True),
    # look equal but are not
    ("\\boxed{[0,1]}", "(0,1]", False),
    ("\\boxed{1/3}", "0.333", False),
    ("\\boxed{0.333}", "1/3", False),
    ("\\boxed{1.414}", "\\sqrt{2}", False),
    ("\\boxed{3}", "-3", False),
    ("\\boxed{e^{2}}", "2e", False),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{\\frac{3}{2}}", False),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("\\boxed{2\\pi}", "\\pi", False),
    # malformed boxes
    ("\\boxed{2", "2", False),
    ("\\boxed{}", "2", False),
    ("no answer here", "2", False),
    ("", "2", False),
    # unicode: full-width and Arabic-Indic digits are digits
    ("答案是 \\boxed{１２}", "12", True),
    ("\\boxed{١٢}", "12", True),
    ("\\boxed{１３}", "12", False),
]


@pytest.mark.parametrize("response,gold,correct", CASES)
def test_math_table(response, gold, correct):
    score = MathReward(RewardConfig()).score(ScoreItem(fn="math", response=response, truth=gold))
    assert score.score == float(correct), score.reason
    assert score.components["correct"] == float(correct)
    assert score.reason == "correct" if correct else score.reason != "correct"


def test_math_reason_says_what_was_wrong():
    score = MathReward(RewardConfig()).score(ScoreItem(response="\\boxed{3}", truth="-3"))
    assert score.reason.startswith("wrong: got 3")
    missing = MathReward(RewardConfig()).score(ScoreItem(response="nothing", truth="1"))
    assert missing.reason == "no answer found" and missing.components["parsed"] == 0.0


def test_math_rejects_truth_it_cannot_use():
    with pytest.raises(ValueError, match="answer string or number"):
        MathReward(RewardConfig()).score(ScoreItem(response="\\boxed{1}", truth=[1, 2]))


async def test_pathological_parse_is_killed_and_the_pool_recovers():
    config = RewardConfig(functions={"math": 1.0}, workers=1, timeout=1.5)
    async with LocalScorer(config=config) as scorer:
        await scorer.start()
        evil = "\\boxed{" + "(" * 3000 + "}"
        [slow] = await scorer.score([ScoreItem(response=evil, truth="1")])
        assert slow.score == 0.0 and slow.reason == "timeout"
        assert scorer.stats["math"]["timeouts"] == 1
        # the killed worker is replaced: the next item is scored normally
        [good] = await scorer.score([ScoreItem(response="\\boxed{1}", truth="1")])
        assert good.score == 1.0 and good.reason == "correct"


async def test_a_worker_that_dies_mid_evaluation_is_an_error_and_is_replaced():
    import asyncio
    import os
    import signal

    config = RewardConfig(functions={"math": 1.0}, workers=1, timeout=BACKSTOP,
                          request_timeout=BACKSTOP)
    async with LocalScorer(config=config) as scorer:
        await scorer.start()
        [worker] = list(scorer._pool._all)
        evil = ScoreItem(response="\\boxed{" + "(" * 3000 + "}", truth="1")
        idle = cpu_seconds(worker.proc.pid)
        pending = asyncio.create_task(scorer.score([evil]))
        deadline = time.monotonic() + BACKSTOP
        while cpu_seconds(worker.proc.pid) < idle + 0.05:  # it is parsing: mid-evaluation
            assert time.monotonic() < deadline and not pending.done()
            await asyncio.sleep(0.01)
        os.kill(worker.proc.pid, signal.SIGKILL)
        [died] = await pending
        # killed by us (-9), or first by the parse itself: either way an error, then replaced
        assert died.score == 0.0 and "died with exit code" in died.reason, died.reason
        assert scorer.stats["math"]["errors"] == 1
        [good] = await scorer.score([ScoreItem(response="\\boxed{2}", truth="2")])
        assert good.score == 1.0


async def test_a_pool_that_cannot_start_fails_every_item_quickly(monkeypatch):
    from tandem.reward import pool

    monkeypatch.setattr(pool, "STARTUP_TIMEOUT", 0.01)  # no worker can import that fast
    config = RewardConfig(functions={"math": 1.0}, workers=2, timeout=BACKSTOP,
                          request_timeout=BACKSTOP)
    async with LocalScorer(config=config) as scorer:
        scores = await scorer.score([ScoreItem(response="\\boxed{1}", truth="1")] * 3)
    assert all(s.score == 0.0 and "did not start within" in s.reason for s in scores), scores
    assert scorer.stats["math"]["errors"] == 3


async def test_a_fresh_workers_first_item_pays_no_warm_up_inside_its_time_limit():
    """math-verify builds its grammar on the first parse (0.16 s of CPU on 2 quiet cores, over
    a second on a loaded one): a worker does that before it says ready, so the first item a
    fresh (or replacement) worker scores costs what every later one costs. Measured in the
    worker's own CPU seconds, which another load on the machine does not stretch."""
    config = RewardConfig(functions={"math": 1.0}, workers=1, timeout=BACKSTOP,
                          request_timeout=BACKSTOP)
    async with LocalScorer(config=config) as scorer:
        await scorer.start()
        [worker] = list(scorer._pool._all)
        costs = []
        for n in (2, 3, 4):
            before = cpu_seconds(worker.proc.pid)
            [score] = await scorer.score([ScoreItem(response=f"\\boxed{{\\frac{{1}}{{{n}}}}}",
                                                    truth=str(1 / n))])
            costs.append(cpu_seconds(worker.proc.pid) - before)
            assert score.score == 1.0, score
        # clock ticks are 10 ms: the first may cost a tick or two more, not the grammar
        assert costs[0] <= min(costs[1:]) + 0.03, costs
