"""RL algorithms as small functions: advantages, policy losses, KL, corrections.

The advantage estimators, policy losses and off-policy corrections are found by name in
`ADVANTAGES`, `POLICY_LOSSES` and `CORRECTIONS` of `tandem.common.plugins` (re-exported here),
where `tandem.trainer.builtins` registers tandem's own, with what each needs, and a plugin
registers its own.
"""

from tandem.common.plugins import ADVANTAGES, CORRECTIONS, POLICY_LOSSES, LossNeeds

from .. import builtins
from .advantages import AdvantageInputs, Advantages
from .aggregation import Aggregator
from .corrections import CorrectionInputs, apply_corrections
from .filters import informative_rows
from .kl import kl_estimate
from .off_policy import behaviour_weights, mismatch_metrics
from .policy_losses import PolicyInputs
from .value import ValueHead, value_loss

__all__ = [
    "ADVANTAGES",
    "CORRECTIONS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "Advantages",
    "Aggregator",
    "CorrectionInputs",
    "LossNeeds",
    "PolicyInputs",
    "ValueHead",
    "apply_corrections",
    "behaviour_weights",
    "informative_rows",
    "kl_estimate",
    "mismatch_metrics",
    "value_loss",
]
