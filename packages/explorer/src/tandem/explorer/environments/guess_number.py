"""`guess_number`: find a secret whole number with higher/lower feedback.

The model writes `<guess>N</guess>`; the environment answers `<feedback>higher</feedback>`,
`lower`, or ends the episode when the guess is right or the guesses run out. The verifier also
scores consistency: a guess outside the range the feedback so far allows is a wasted guess.
"""

from __future__ import annotations

import random
import re
from typing import Any

from .base import Environment, Outcome, Reply

_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>\s*$", re.DOTALL)


class GuessNumber(Environment):
    """Payload: `low`, `high` (inclusive) and `secret`, or a `seed` that picks the secret."""

    name = "guess_number"
    stop = ("</guess>",)

    def __init__(self, payload: dict[str, Any], *, max_guesses: int = 8,
                 format_weight: float = 0.1):
        super().__init__(payload)
        self.low = int(payload.get("low", 1))
        self.high = int(payload.get("high", 100))
        if self.low > self.high:
            raise ValueError(f"guess_number task: low {self.low} > high {self.high}")
        if "secret" in payload:
            self.secret = int(payload["secret"])
        elif "seed" in payload:
            self.secret = random.Random(int(payload["seed"])).randint(self.low, self.high)
        else:
            raise ValueError(f"guess_number task needs `secret` or `seed` (has {sorted(payload)})")
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"guess_number task: secret {self.secret} outside "
                             f"[{self.low}, {self.high}]")
        self.max_guesses = max_guesses
        self.format_weight = format_weight
        self.lo, self.hi = self.low, self.high  # what the feedback so far still allows
        self.guesses = 0
        self.invalid = 0
        self.inconsistent = 0
        self.solved = False

    def instructions(self) -> str:
        return (f"I am thinking of a whole number from {self.low} to {self.high}. Guess it by "
                "writing <guess>N</guess>; I will answer higher, lower, or end the game when "
                f"you are right. You have {self.max_guesses} guesses.")

    def step(self, action: str) -> Reply:
        self.guesses += 1
        m = _GUESS.search(action)
        if m is None:
            self.invalid += 1
            feedback = "invalid: write <guess>N</guess>"
        else:
            guess = int(m.group(1))
            if not self.lo <= guess <= self.hi:
                self.inconsistent += 1
            if guess == self.secret:
                self.solved = True
                return Reply(done=True)
            if guess < self.secret:
                self.lo = max(self.lo, guess + 1)
                feedback = "higher"
            else:
                self.hi = min(self.hi, guess - 1)
                feedback = "lower"
        if self.guesses >= self.max_guesses:
            return Reply(done=True)
        return Reply(text=f"<feedback>{feedback}</feedback>\n")

    def outcome(self) -> Outcome:
        solved = float(self.solved)
        valid = (self.guesses - self.invalid) / self.guesses if self.guesses else 0.0
        efficiency = solved * (1.0 - (self.guesses - 1) / self.max_guesses)
        reason = f"solved in {self.guesses}" if self.solved else f"not solved in {self.guesses}"
        return Outcome(reward=solved + self.format_weight * valid,
                       components={"solved": solved, "format": valid, "efficiency": efficiency,
                                   "guesses": float(self.guesses),
                                   "inconsistent": float(self.inconsistent)},
                       reason=reason)
