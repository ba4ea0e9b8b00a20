"""The shipped environments and their verifiers, without a model."""

from __future__ import annotations

import pytest

from tandem.explorer.environments import Calculator, GuessNumber, get_environment
from tandem.explorer.environments.calculator import evaluate


@pytest.mark.parametrize("expr,value", [("2+3*4", 14), ("(2+3)*4", 20), ("-7//2", -4),
                                        ("2**10", 1024), ("7/2", 3.5), ("10 % 4", 2)])
def test_calculator_evaluates_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr,why", [("__import__('os')", "not allowed"),
                                      ("1/0", "division by zero"),
                                      ("2**1000", "exponent"), ("9**9**9", "exponent"),
                                      ("x+1", "not allowed"), ("1+", "not an arithmetic"),
                                      ("1" * 300, "longer than")])
def test_calculator_rejects_everything_else(expr, why):
    with pytest.raises(ValueError, match=why):
        evaluate(expr)


def test_calculator_episode_tool_call_then_answer():
    env = Calculator({"question": "What is 37*41+12?", "answer": "1529"})
    reply = env.step("First <calc>37*41</calc>")
    assert reply == type(reply)(text="<result>1517</result>\n", done=False)
    assert env.step("<calc>1517+</calc>").text.startswith("<result>error:")
    assert env.step("so <answer>1529</answer>").done
    out = env.outcome()
    assert out.components == {"correctness": 1.0, "format": 1.0, "tool_calls": 2.0,
                              "tool_errors": 1.0}
    assert out.reward == pytest.approx(1.1) and out.reason == "correct"


def test_calculator_wrong_or_missing_answer_scores_zero():
    env = Calculator({"expression": "6*7"}, format_weight=0.0)
    assert env.step("<answer>41</answer>").done and env.outcome().reward == 0.0
    env = Calculator({"expression": "6*7"})
    assert env.step("I do not know").done
    assert env.outcome().components["format"] == 0.0 and env.outcome().reason == "no answer"
    with pytest.raises(ValueError, match="needs `answer` or `expression`"):
        Calculator({"question": "?"})


def test_calculator_limits_tool_calls():
    env = Calculator({"answer": 1}, max_calls=1)
    assert not env.step("<calc>1+1</calc>").done
    assert env.step("<calc>1+1</calc>").done


def test_guess_number_binary_search_solves_it():
    env = GuessNumber({"low": 1, "high": 100, "secret": 37}, max_guesses=8)
    lo, hi = 1, 100
    while True:
        guess = (lo + hi) // 2
        reply = env.step(f"<guess>{guess}</guess>")
        if reply.done:
            break
        if "higher" in reply.text:
            lo = guess + 1
        else:
            hi = guess - 1
    out = env.outcome()
    assert out.components["solved"] == 1.0 and out.components["inconsistent"] == 0.0
    assert out.components["guesses"] <= 7 and out.reward == pytest.approx(1.1)


def test_guess_number_counts_invalid_and_inconsistent_guesses_and_runs_out():
    env = GuessNumber({"low": 1, "high": 10, "secret": 5}, max_guesses=3)
    assert env.step("<guess>8</guess>").text == "<feedback>lower</feedback>\n"
    assert env.step("<guess>9</guess>").text == "<feedback>lower</feedback>\n"  # inconsistent
    assert env.step("seven").done  # third guess: out of guesses
    out = env.outcome()
    assert out.components["solved"] == 0.0 and out.components["inconsistent"] == 1.0
    assert out.components["format"] == pytest.approx(2 / 3) and out.reward == pytest.approx(0.2 / 3)


def test_guess_number_seed_is_deterministic_and_registry_names_envs():
    a = GuessNumber({"seed": 11, "low": 1, "high": 1000})
    b = GuessNumber({"seed": 11, "low": 1, "high": 1000})
    assert a.secret == b.secret and 1 <= a.secret <= 1000
    assert get_environment("guess_number") is GuessNumber
    with pytest.raises(ValueError, match="outside"):
        GuessNumber({"secret": 0})
