"""`code`: run the response's program against test cases in the sandbox; partial credit.

`truth` holds the tests, in any of the common dataset shapes:
- `{"tests": [{"input": "...", "output": "..."}, ...]}` or a bare list of such dicts,
  `{"inputs": [...], "outputs": [...]}` (APPS; also as a JSON string) or
  `{"input": [...], "output": [...]}` (CodeContests): stdin/stdout tests; the program reads
  the input and its stdout must equal the output (trailing whitespace of each line and
  trailing blank lines ignored; `args.compare: tokens` compares whitespace-separated tokens
  instead);
- `{"asserts": ["assert f(1) == 2", ...]}` (alias `test_list`, with optional `setup` code run
  first): each assertion is one test, run after the program in the same process.

Every test is its own sandboxed run. Stdio output is compared here, outside the sandbox;
assert tests run in a harness process the candidate cannot reach, which sees the program's
values only as plain data (see `tandem.common.sandbox_runner`). The program is the last fenced
code block of the response (```python ... ```), or the whole response when it has none.

Limits compose: each test has `code.cpu_seconds` and `code.wall_seconds`; the evaluation as a
whole has a budget of (tests) × (`wall_seconds` + `STARTUP_SECONDS`) instead of
`reward.timeout`, cut short only by the caller's deadline. When a test ends by the wall clock
or the CPU limit, or the budget runs out, the remaining tests are not run and count as failed:
the score is the fraction passed so far, never a blanket `timeout`.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from tandem.common.messages.reward import Score, ScoreItem
from tandem.common.sandbox import Run, Sandbox

from ..base import AsyncReward, register, result

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_FATAL = {"timeout", "cpu"}
STARTUP_SECONDS = 1.0  # per test, on top of its wall clock: building the sandbox, reaping it


def extract_program(response: str) -> str:
    """The last fenced block (preferring python-tagged ones), else the whole response."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]


def parse_tests(truth: Any) -> tuple[str, list[Any], str]:
    """(mode, tests, setup): mode `stdio` with (input, output) pairs or `assert` with code."""
    if isinstance(truth, str):  # APPS keeps its tests as a JSON string
        try:
            truth = json.loads(truth)
        except ValueError as exc:
            raise ValueError(f"code truth is a string but not JSON: {exc}") from None
    if isinstance(truth, dict) and truth.get("fn_name"):
        raise ValueError(f"code truth calls function {truth['fn_name']!r} (APPS call-based); "
                         "give those tests as asserts instead")
    if isinstance(truth, dict) and isinstance(truth.get("input"), list):
        truth = {"inputs": truth["input"], "outputs": truth.get("output", [])}  # CodeContests
    if isinstance(truth, list):
        truth = {"tests": truth}
    if not isinstance(truth, dict):
        raise ValueError(f"code needs truth with tests, inputs/outputs or asserts, got {truth!r}")
    if "tests" in truth:
        pairs = [(str(t["input"]), str(t["output"])) for t in truth["tests"]]
        return "stdio", pairs, ""
    if "inputs" in truth:
        inputs, outputs = truth["inputs"], truth.get("outputs", [])
        if len(inputs) != len(outputs):
            raise ValueError(f"code truth has {len(inputs)} inputs but {len(outputs)} outputs")
        return "stdio", [(str(i), str(o)) for i, o in zip(inputs, outputs)], ""
    asserts = truth.get("asserts", truth.get("test_list"))
    if asserts is not None:
        return "assert", [str(a) for a in asserts], str(truth.get("setup", ""))
    raise ValueError(f"code truth needs tests, inputs/outputs or asserts; got keys {sorted(truth)}")


def same_output(got: str, want: str, compare: str = "lines") -> bool:
    if compare == "tokens":
        return got.split() == want.split()
    norm = lambda s: [ln.rstrip() for ln in s.replace("\r\n", "\n").rstrip().split("\n")]
    return norm(got) == norm(want)


@register("code")
class CodeReward(AsyncReward):
    """Fraction of tests passed."""

    one_per_worker = True
    budgeted = True

    def __init__(self, config):
        super().__init__(config)
        self.sandbox = Sandbox(config.code, slots=config.workers)

    async def start(self) -> None:
        await self.sandbox.start()

    async def close(self) -> None:
        await self.sandbox.close()

    def budget(self, item: ScoreItem) -> float:
        """Seconds the whole evaluation may take: it scales with the number of tests."""
        try:
            count = len(parse_tests(item.truth)[1])
        except (ValueError, KeyError, TypeError):
            count = 1  # score() reports the bad truth
        return max(1, count) * (self.config.code.wall_seconds + STARTUP_SECONDS)

    async def score(self, item: ScoreItem, *, deadline: float | None = None) -> Score:
        """Grade every test; past `deadline` (time.monotonic()) the rest count as failed."""
        mode, tests, setup = parse_tests(item.truth)
        if not tests:
            raise ValueError("code truth has no tests")
        if deadline is None:
            deadline = time.monotonic() + self.budget(item)
        program = item.response
        if item.args.get("extract", True):
            program = extract_program(program)
        compare = item.args.get("compare", "lines")
        passed, first_failure = 0, ""
        for index, test in enumerate(tests):
            left = deadline - time.monotonic()
            if left <= 0:
                if not first_failure:
                    first_failure = f"test {index + 1}: budget spent"
                break
            if mode == "stdio":
                run = await self.sandbox.run(program, stdin=test[0].encode(), wall_seconds=left)
                ok, why = self._grade_stdio(run, test[1], compare)
            else:
                run = await self.sandbox.run(program, test=test, setup=setup, wall_seconds=left)
                ok, why = run.status == "ok", self._why(run)
            passed += ok
            if not ok and not first_failure:
                first_failure = f"test {index + 1}: {why}"
            if run.status in _FATAL:
                break
        total = len(tests)
        reason = f"{passed}/{total} tests passed"
        if first_failure:
            reason += f"; {first_failure}"
        return result(passed / total, reason, pass_rate=passed / total, passed=passed, total=total)

    def _grade_stdio(self, run: Run, want: str, compare: str) -> tuple[bool, str]:
        if run.status != "ok":
            return False, self._why(run)
        if same_output(run.stdout.decode(errors="replace"), want, compare):
            return True, ""
        return False, "wrong_answer"

    @staticmethod
    def _why(run: Run) -> str:
        if run.status == "ok":
            return ""
        if run.status == "exit":
            return f"exit code {run.exit_code}" + (f" ({run.detail})" if run.detail else "")
        return f"{run.status} ({run.detail})" if run.detail and run.status not in (
            "timeout", "cpu", "output_limit", "not_reached") else run.status
