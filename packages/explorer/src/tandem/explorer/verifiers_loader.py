"""Environments in the `verifiers` format (the Environments Hub's), loaded unchanged: the
environment for the `verifiers` workflow, and its dataset as a taskset (the `verifiers` taskset
reader).

Light on purpose: it imports `verifiers` and nothing of torch, so the master can read a taskset
through it. `verifiers` is the optional extra `tandem-explorer[verifiers]`; its classic API
(`vf.load_environment`, `Environment.get_dataset`, `rollout`, `rubric`) is the one supported,
which verifiers 0.1.11 to 0.3 serve (0.4 keeps only its new `verifiers.v1` stack).
"""

from __future__ import annotations

import importlib
import signal
from contextlib import contextmanager
from typing import Any, Iterator, Literal

from tandem.common.errors import ConfigError

INSTALL = "pip install 'tandem-explorer[verifiers]'"


def import_verifiers(where: str) -> Any:
    """`import verifiers as vf`, or a one-line error naming `where` and how to install it."""
    try:
        import verifiers as vf

        vf.Environment  # noqa: B018 - 0.4 and later have no classic API: fail here, by name
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{where}: a verifiers environment needs the classic verifiers API "
                         f"(verifiers>=0.1.11,<0.4): {INSTALL} ({type(exc).__name__}: "
                         f"{exc})") from None
    return vf


@contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """verifiers' `Environment` installs SIGINT and SIGTERM handlers of its own (exit at once);
    the explorer owns those signals (a signal sets a flag, the loop drains), so they are put
    back as they were."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def load_environment(spec: str, env_args: dict[str, Any] | None = None, *,
                     where: str = "workflow_args.env") -> Any:
    """The verifiers environment `spec` names, built with `env_args`.

    `spec` is an environment id, loaded as verifiers loads it (`vf.load_environment`: the
    installed module of that name, `-` read as `_`, and its `load_environment(**env_args)`), or
    `"package.module:function"`, a function called with `env_args` that returns one.
    """
    vf = import_verifiers(where)
    env_args = dict(env_args or {})
    module_name, sep, attr = spec.partition(":")
    with _signal_handlers_kept():
        if sep:
            if not module_name or not attr:
                raise ValueError(f"{where} {spec!r}: expected an environment id or "
                                 "'package.module:function'")
            try:
                fn: Any = importlib.import_module(module_name)
            except ImportError as exc:
                raise ValueError(f"{where} {spec!r}: cannot import {module_name}: {exc}") from None
            for part in attr.split("."):
                fn = getattr(fn, part, None)
                if fn is None:
                    raise ValueError(f"{where} {spec!r}: {module_name} has no {attr}")
            if not callable(fn):
                raise ValueError(f"{where} {spec!r} is not a function")
            try:
                env = fn(**env_args)
            except TypeError as exc:
                raise ValueError(f"{where} {spec!r} with env_args {sorted(env_args)}: "
                                 f"{exc}") from None
        else:
            try:
                env = vf.load_environment(spec, **env_args)
            except (ValueError, RuntimeError, AttributeError) as exc:
                raise ValueError(f"{where} {spec!r}: {exc}") from None
    if not isinstance(env, vf.Environment):
        raise ValueError(f"{where} {spec!r} gave a {type(env).__name__}, not a "
                         "verifiers Environment")
    return env


def read_taskset(env: str, env_args: dict[str, Any] | None = None,
                 split: Literal["train", "eval"] = "train", num_examples: int = -1, *,
                 key: str = "master.taskset") -> list[dict[str, Any]]:
    """The taskset reader `verifiers`: the rows of the environment's dataset (`split` train:
    `get_dataset()`, eval: `get_eval_dataset()`), first `num_examples` of them (-1: all), each
    a verifiers rollout input (`prompt` as chat messages, `answer`, `info`, `example_id`) that
    the `verifiers` workflow rolls out as it is. ConfigError naming `key` on a problem."""
    try:
        environment = load_environment(env, env_args, where=f"{key}.env")
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    if split not in ("train", "eval"):
        raise ConfigError([f"{key}.split: {split!r}; a verifiers environment has train and "
                           "eval"])
    try:
        data = (environment.get_dataset(n=num_examples) if split == "train"
                else environment.get_eval_dataset(n=num_examples))
    except ValueError as exc:  # no dataset of that split
        raise ConfigError([f"{key}: environment {env!r} has no {split} dataset: {exc}"]) from None
    rows = [dict(row) for row in data]
    if not rows:
        raise ConfigError([f"{key}: environment {env!r}'s {split} dataset is empty"])
    missing = [i for i, row in enumerate(rows) if "prompt" not in row]
    if missing:
        raise ConfigError([f"{key}: rows {missing[:5]} of environment {env!r} have no prompt"])
    return rows
