"""The `digit_retry` environment: the model answers; a wrong answer gets a hint and one more
attempt.

The hint shows which digits were right (`27_` for 275 against 274) and asks again, so the
second attempt is read against the first. Each model turn is one attempt: the workflow gives
it `max_tokens` (the answer's length) and the environment takes what it wrote.
"""

from __future__ import annotations

from typing import Any

from tandem.explorer.environments import Environment, Outcome, Reply


def hint(attempt: str, answer: str) -> str:
    """The answer's digits where the attempt has them right, `_` elsewhere."""
    return "".join(a if i < len(attempt) and attempt[i] == a else "_"
                   for i, a in enumerate(answer))


class DigitRetry(Environment):
    """Payload: `prompt` (`rev 472=`) and `answer` (`274`), as the `digit_task` format makes
    them."""

    name = "digit_retry"

    def __init__(self, payload: dict[str, Any], *, attempts: int = 2):
        super().__init__(payload)
        if "prompt" not in payload or "answer" not in payload:
            raise ValueError(f"digit_retry needs `prompt` and `answer` (has {sorted(payload)}); "
                             "set master.taskset.format: {name: digit_task, ...}")
        self.prompt, self.answer = str(payload["prompt"]), str(payload["answer"])
        self.max_attempts = attempts
        self.attempts: list[str] = []

    def instructions(self) -> str:
        return self.prompt

    def step(self, action: str) -> Reply:
        attempt = action.strip()
        self.attempts.append(attempt)
        if attempt == self.answer or len(self.attempts) >= self.max_attempts:
            return Reply(done=True)
        return Reply(text=f" {hint(attempt, self.answer)}\n{self.prompt}")

    def outcome(self) -> Outcome:
        solved = bool(self.attempts) and self.attempts[-1] == self.answer
        return Outcome(reward=float(solved),
                       components={"attempts": float(len(self.attempts)), "solved": float(solved)},
                       reason=f"attempts {self.attempts} for {self.answer}")
