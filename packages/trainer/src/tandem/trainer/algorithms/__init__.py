"""RL algorithms as small registered functions: advantages, policy losses, KL, corrections."""

from .advantages import ADVANTAGES, AdvantageInputs, Advantages
from .aggregation import Aggregator
from .filters import informative_rows
from .kl import kl_estimate
from .off_policy import behaviour_weights, mismatch_metrics
from .policy_losses import POLICY_LOSSES, PolicyInputs
from .registry import Registry
from .value import ValueHead, value_loss

__all__ = [
    "ADVANTAGES", "AdvantageInputs", "Advantages", "Aggregator", "POLICY_LOSSES", "PolicyInputs",
    "Registry", "ValueHead", "behaviour_weights", "informative_rows", "kl_estimate",
    "mismatch_metrics", "value_loss",
]
