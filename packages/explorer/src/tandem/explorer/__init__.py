"""tandem-explorer: inference engines, workflows and environments, rollouts into experiences,
loading new weights. Heavy modules (torch, transformers) load on first use of what needs them.

- `Engine`, `TensorEngine`, `WorkerFetchEngine`, `Completion` (engine), `create_engine`
  (engines), `TransformersEngine` (transformers_engine), `VLLMEngine` (vllm_engine),
  `RemoteEngine` (remote_engine: an OpenAI-compatible server elsewhere)
- `SamplingParams`, `policy_logprobs` (sampling): the one definition of a behaviour logprob
- `create_workflow`, `SingleTurn`, `MultiTurn`, `RolloutContext` (workflows)
- `Calculator`, `GuessNumber` and the environment registry (environments)
- `create_scorer` (rewards), `WeightLoader` (weights), `Explorer` (service)
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Engine": "engine", "TensorEngine": "engine", "WorkerFetchEngine": "engine",
    "Completion": "engine", "create_engine": "engines",
    "TransformersEngine": "transformers_engine", "VLLMEngine": "vllm_engine",
    "RemoteEngine": "remote_engine",
    "SamplingParams": "sampling", "policy_logprobs": "sampling",
    "create_workflow": "workflows", "SingleTurn": "workflows", "MultiTurn": "workflows",
    "RolloutContext": "workflows",
    "Calculator": "environments", "GuessNumber": "environments", "get_environment": "environments",
    "create_scorer": "rewards", "WeightLoader": "weights", "Explorer": "service",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
