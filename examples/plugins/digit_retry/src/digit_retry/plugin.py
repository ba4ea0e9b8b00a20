"""Everything digit_retry adds to tandem, registered by name: the entry point
`tandem.plugins: digit_retry` imports this module in every process that reads a run config.

Each item is given as `module:attr`, imported only by the process that uses it, so the master
and the buffer load this module without torch or the explorer. What an item declares (the
workflow's scorer, the loss's parameters) is data the config and the components read.
"""

from pydantic import BaseModel, Field

from tandem.common.plugins import (
    ENVIRONMENTS, POLICY_LOSSES, REWARDS, TASKSET_FORMATS, WORKFLOWS, LossNeeds)


class CispoParams(BaseModel):
    """The `cispo` loss's parameters: `trainer.loss: {name: cispo, max_weight: 2.0}`."""

    max_weight: float = Field(default=2.0, gt=0,
                              description="cap on a token's importance weight (no gradient)")


REWARDS.register("digit_match", "digit_retry.reward:DigitMatch", kind="pure")
ENVIRONMENTS.register("digit_retry", "digit_retry.environment:DigitRetry")
# scorer=True: the explorer hands this workflow the run's reward scorer (ctx.scorer)
WORKFLOWS.register("scored_multi_turn", "digit_retry.workflow:ScoredMultiTurn", scorer=True)
TASKSET_FORMATS.register("digit_task", "digit_retry.taskset:digit_task")
POLICY_LOSSES.register("cispo", "digit_retry.loss:cispo", needs=LossNeeds(params=CispoParams))
