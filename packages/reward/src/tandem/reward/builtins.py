"""tandem-reward's own reward functions, registered as a plugin like any user's (entry point
`tandem.plugins: reward`); each module loads only when a run scores with it."""

from tandem.common.plugins import REWARDS

_F = "tandem.reward.functions"

REWARDS.register("math", f"{_F}.math_answer:MathReward")
REWARDS.register("k12", f"{_F}.k12:K12Reward")
REWARDS.register("vision", f"{_F}.vision:VisionReward")
REWARDS.register("format", f"{_F}.format:FormatReward")
REWARDS.register("length", f"{_F}.length:LengthReward")
REWARDS.register("code", f"{_F}.code_tests:CodeReward")
REWARDS.register("reward_model", f"{_F}.reward_model:RewardModelReward")
