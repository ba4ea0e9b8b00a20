"""tandem-trainer: RL algorithms and losses, the optimisation loop, checkpoints, publishing weights.

- `Trainer(config)`: the component; `train_step(experiences)` without sockets, `await run()`
  against a live master and buffer, `follow()` on ranks > 0 under torchrun.
- `Learner`: model, reference, optimiser and one step, with no wiring at all.
- `tandem.trainer.algorithms`: registries of advantage estimators and policy losses.

Names are imported on first use, so `tandem-trainer --help` does not load torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"Learner": ".learner", "Trainer": ".trainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
