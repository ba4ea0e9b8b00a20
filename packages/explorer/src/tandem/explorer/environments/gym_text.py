"""Gymnasium-style text environments: one episode's bookkeeping around a `reset`/`step` object.

Any object with Gymnasium's `Env` API over text works, `gymnasium` itself is not needed:
`reset(seed=..., options=...) -> (observation, info)` and
`step(action) -> (observation, reward, terminated, truncated, info)`, observations and actions
strings. An episode (`GymEpisode`) is:

- `reset(seed=payload["seed"] if the task has one, options=payload)` (only the keywords the
  environment's `reset` takes): its observation is the first user turn;
- each model turn's text is an action; `step`'s observation is the next user turn, until
  `terminated` or `truncated` (the `gym` workflow may also end it at its own limits);
- the reward is the sum of the rewards `step` returned (`reward: last`: the last one), with the
  components `return` (the sum), `last`, `steps` and `terminated`.

A `reset` or `step` that raises, or answers something else (an observation that is not a
string, a `step` result that is not five values), is a `GymEpisodeError` naming the call.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal
from collections.abc import Callable

from tandem.common.plugins import ENVIRONMENTS, registered_or_imported

from .base import Environment


class GymEpisodeError(Exception):
    """The environment's `reset` or `step` raised or answered something else."""


def resolve_gym_env(spec: str, *, where: str = "workflow_args.env") -> Callable[..., Any]:
    """The class (or factory) `spec` names: "package.module:EnvClass", or a name a plugin
    registered it under in `ENVIRONMENTS`."""
    target = registered_or_imported(ENVIRONMENTS, spec, where, "'package.module:EnvClass'")
    if isinstance(target, type) and issubclass(target, Environment):
        raise ValueError(f"{where} {spec!r} is a tandem Environment: run it with the "
                         "multi_turn workflow")
    if not callable(target) or not all(callable(getattr(target, m, None))
                                       for m in ("reset", "step")):
        raise ValueError(f"{where} {spec!r} is not a Gymnasium-style environment "
                         "(a class with reset and step)")
    return target


class GymEpisode:
    """One episode: `first` is the first observation; `step(action)` returns the next one, or
    None once the environment has ended the episode; `outcome()` scores it and closes the
    environment (see the module docstring)."""

    def __init__(self, env: Any, payload: dict[str, Any], *, name: str,
                 reward: Literal["sum", "last"] = "sum"):
        self.env = env
        self.name = name
        self.reward_rule = reward
        self.rewards: list[float] = []
        self.done = False
        self.terminated = False
        params = inspect.signature(env.reset).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        kwargs: dict[str, Any] = {}
        if "seed" in payload and ("seed" in params or takes_all):
            kwargs["seed"] = int(payload["seed"])
        if "options" in params or takes_all:
            kwargs["options"] = dict(payload)
        try:
            result = self._call("reset", **kwargs)
            self.first = self._text(result[0] if isinstance(result, tuple) else result, "reset")
        except GymEpisodeError:
            self.close()
            raise

    def step(self, action: str) -> str | None:
        result = self._call("step", action)
        if not isinstance(result, tuple) or len(result) != 5:
            raise GymEpisodeError(f"{self.name}.step returned {type(result).__name__} "
                                  f"{str(result)[:80]}; expected (observation, reward, "
                                  "terminated, truncated, info)")
        observation, reward, terminated, truncated, _ = result
        try:
            self.rewards.append(float(reward))
        except (TypeError, ValueError):
            raise GymEpisodeError(f"{self.name}.step returned the reward {reward!r}, "
                                  "not a number") from None
        if terminated or truncated:
            self.done = True
            self.terminated = bool(terminated)
            return None
        return self._text(observation, "step")

    def outcome(self) -> dict[str, float]:
        """`reward` and its components, for the workflow's experiences."""
        total = sum(self.rewards)
        last = self.rewards[-1] if self.rewards else 0.0
        return {"reward": total if self.reward_rule == "sum" else last, "return": total,
                "last": last, "steps": float(len(self.rewards)),
                "terminated": float(self.terminated)}

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.env, method)(*args, **kwargs)
        except Exception as exc:
            raise GymEpisodeError(f"{self.name}.{method} raised {type(exc).__name__}: "
                                  f"{str(exc)[:200]}") from exc

    def _text(self, observation: Any, method: str) -> str:
        if not isinstance(observation, str):
            raise GymEpisodeError(f"{self.name}.{method} returned a "
                                  f"{type(observation).__name__} observation; a text "
                                  "environment's observations are strings")
        return observation
