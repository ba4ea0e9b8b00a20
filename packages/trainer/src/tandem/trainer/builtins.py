"""tandem-trainer's own advantage estimators, policy losses and off-policy corrections,
registered as a plugin like any user's (entry point `tandem.plugins: trainer`), each with what
it needs.

Each is named by `module:attr` and imported only when a trainer uses it: the master and
`tandem up` load this module to check a config, so it imports nothing but `tandem.common`.
What a loss declares (`LossNeeds`) is all the learner and the config know of it: whether a
reference model is loaded, whether rows come as (chosen, rejected) pairs, whether advantages
are computed, which model checks its own parameters.
"""

from tandem.common.config.trainer import (
    BandParams, CapParams, CISPOParams, DPOParams, IcePopParams, M2POParams)
from tandem.common.plugins import ADVANTAGES, CORRECTIONS, POLICY_LOSSES, LossNeeds

_A = "tandem.trainer.algorithms.advantages"
_L = "tandem.trainer.algorithms.policy_losses"
_C = "tandem.trainer.algorithms.corrections"

ADVANTAGES.register("grpo", f"{_A}:grpo")
ADVANTAGES.register("dr_grpo", f"{_A}:dr_grpo")
ADVANTAGES.register("rloo", f"{_A}:rloo")
ADVANTAGES.register("reinforce_pp", f"{_A}:reinforce_pp")
# reads the value head's predictions and returns its targets: the trainer trains one
ADVANTAGES.register("gae", f"{_A}:gae", value_head=True)
# reads a teacher's logprobs of the sampled tokens: the trainer loads trainer.teacher
ADVANTAGES.register("distill", "tandem.trainer.algorithms.distill:distill", teacher=True)

POLICY_LOSSES.register("ppo_clip", f"{_L}:ppo_clip", needs=LossNeeds())
POLICY_LOSSES.register("gspo", f"{_L}:gspo", needs=LossNeeds())
POLICY_LOSSES.register("pg", f"{_L}:policy_gradient", needs=LossNeeds())
# `cispo` is the name the digit_retry example plugin registers for its own version
POLICY_LOSSES.register("cispo_clip", f"{_L}:cispo_clip", needs=LossNeeds(params=CISPOParams))
POLICY_LOSSES.register("sft", f"{_L}:sft", needs=LossNeeds(advantages=False))
POLICY_LOSSES.register("dpo", f"{_L}:dpo", needs=LossNeeds(
    reference=True, pairs=True, advantages=False, params=DPOParams))

CORRECTIONS.register("truncated_is", f"{_C}:truncated_is", params=CapParams)
CORRECTIONS.register("masked_is", f"{_C}:masked_is", params=BandParams)
CORRECTIONS.register("seq_is", f"{_C}:seq_is", params=CapParams)
CORRECTIONS.register("seq_masked_is", f"{_C}:seq_masked_is", params=BandParams)
CORRECTIONS.register("icepop", f"{_C}:icepop", params=IcePopParams)
CORRECTIONS.register("m2po", f"{_C}:m2po", params=M2POParams)
