"""`calculator`: an arithmetic word problem with a calculator tool.

The model may call `<calc>EXPRESSION</calc>`; the environment answers `<result>VALUE</result>`.
The episode ends at `<answer>NUMBER</answer>`, checked against the task's answer (or the value
of the task's `expression` when no answer is given).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

from .base import Environment, Outcome, Reply

_CALC = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>\s*$", re.DOTALL)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18


def evaluate(expression: str) -> float | int:
    """Arithmetic only: numbers, + - * / // % ** and parentheses; anything else is a ValueError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"{type(node).__name__} is not allowed")


def format_number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def parse_number(text: str) -> float | None:
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class Calculator(Environment):
    """Payload: `question` and `answer`, or just `expression` (the question asks for its value)."""

    name = "calculator"
    stop = ("</calc>", "</answer>")

    def __init__(self, payload: dict[str, Any], *, max_calls: int = 8, format_weight: float = 0.1):
        super().__init__(payload)
        if "answer" in payload:
            truth = parse_number(str(payload["answer"]))
        elif "expression" in payload:
            truth = float(evaluate(str(payload["expression"])))
        else:
            raise ValueError(
                f"calculator task needs `answer` or `expression` (has {sorted(payload)})")
        if truth is None:
            raise ValueError(f"calculator task answer {payload['answer']!r} is not a number")
        self.truth = truth
        self.max_calls = max_calls
        self.format_weight = format_weight
        self.calls = 0
        self.errors = 0
        self.answer: float | None = None
        self.answered = False

    def instructions(self) -> str:
        question = self.payload.get("question") or f"What is {self.payload['expression']}?"
        return (f"{question}\nYou can use a calculator: write <calc>EXPRESSION</calc> and you get "
                "<result>VALUE</result>. Give the final answer as <answer>NUMBER</answer>.")

    def step(self, action: str) -> Reply:
        if (m := _ANSWER.search(action)) is not None:
            self.answered = True
            self.answer = parse_number(m.group(1))
            return Reply(done=True)
        if (m := _CALC.search(action)) is not None:
            if self.calls >= self.max_calls:
                return Reply(done=True)
            self.calls += 1
            try:
                result = format_number(evaluate(m.group(1)))
            except ValueError as exc:
                self.errors += 1
                result = f"error: {exc}"
            return Reply(text=f"<result>{result}</result>\n")
        return Reply(done=True)  # neither a tool call nor an answer: the episode is over

    def outcome(self) -> Outcome:
        correct = float(self.answer is not None and math.isclose(
            self.answer, self.truth, rel_tol=1e-6, abs_tol=1e-6))
        fmt = float(self.answered)
        reason = "correct" if correct else ("wrong answer" if self.answered else "no answer")
        return Outcome(reward=correct + self.format_weight * fmt,
                       components={"correctness": correct, "format": fmt,
                                   "tool_calls": float(self.calls),
                                   "tool_errors": float(self.errors)},
                       reason=reason)
