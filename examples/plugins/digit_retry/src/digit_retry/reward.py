"""The `digit_match` reward: partial credit per digit, and a second attempt worth part of what
the first one missed.

    score = first + (1 - first) * retry_weight * second

where `first` and `second` are the shares of the answer's digits each attempt has in place
(`args.attempts`; without it the response is the one attempt). It runs isolated: in one of
the scorer's worker processes, killed if it overruns `reward.timeout`. Its reason names that
process, so a run shows where its rewards were computed.
"""

from __future__ import annotations

import os

from tandem.common.messages.reward import Score, ScoreItem
from tandem.reward import PureReward, register, result


def credit(attempt: str, answer: str) -> float:
    """The share of the answer's digits the attempt has in their place."""
    return sum(a == b for a, b in zip(attempt, answer)) / len(answer) if answer else 0.0


@register("digit_match")
class DigitMatch(PureReward):
    isolated = True  # scored in a worker process under the per-item time limit

    def score(self, item: ScoreItem) -> Score:
        answer = str(item.truth)
        attempts = [str(a) for a in item.args.get("attempts", [item.response])][:2]
        first = credit(attempts[0], answer) if attempts else 0.0
        second = credit(attempts[1], answer) if len(attempts) > 1 else 0.0
        retry_weight = float(item.args.get("retry_weight", 0.5))
        score = first + (1.0 - first) * retry_weight * second
        return result(score, f"{'/'.join(attempts) or 'no attempt'} for {answer} "
                             f"(pid {os.getpid()})",
                      first=first, second=second, solved=float(answer in attempts))
