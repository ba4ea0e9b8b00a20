"""RL algorithms as small functions: advantages, policy losses, KL, corrections.

The advantage estimators and policy losses are found by name in `ADVANTAGES` and
`POLICY_LOSSES` of `tandem.common.plugins` (re-exported here), where `tandem.trainer.builtins`
registers tandem's own, with what each needs, and a plugin registers its own.
"""

from tandem.common.plugins import ADVANTAGES, POLICY_LOSSES, LossNeeds

from .. import builtins
from .advantages import AdvantageInputs, Advantages
from .aggregation import Aggregator
from .filters import informative_rows
from .kl import kl_estimate
from .off_policy import behaviour_weights, mismatch_metrics
from .policy_losses import PolicyInputs
from .value import ValueHead, value_loss

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "Advantages",
    "Aggregator",
    "LossNeeds",
    "PolicyInputs",
    "ValueHead",
    "behaviour_weights",
    "informative_rows",
    "kl_estimate",
    "mismatch_metrics",
    "value_loss",
]
