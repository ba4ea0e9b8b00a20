"""Environments in the `verifiers` format (the Environments Hub's), loaded unchanged: the
environment for the `verifiers` workflow, and its dataset as a taskset (the `verifiers` taskset
reader).

Light on purpose: it imports `verifiers` and nothing of torch, so the master can read a taskset
through it. `verifiers` is the optional extra `tandem-explorer[verifiers]`; its classic API
(`vf.load_environment`, `Environment.get_dataset`, `rollout`, `rubric`) is the one supported,
which verifiers 0.1.11 to 0.3 serve (0.4 keeps only its new `verifiers.v1` stack).
"""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager
from typing import Any
from collections.abc import Iterator
from urllib.parse import unquote

from tandem.common.errors import ConfigError
from tandem.common.registry import import_address

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
    with _signal_handlers_kept():
        if ":" in spec:
            fn = import_address(spec, where, "an environment id or 'package.module:function'")
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


def parse_source(path: str) -> tuple[str, dict[str, Any]]:
    """A taskset path `env?key=value&key=value` as (env, env_args): each value as JSON where it
    parses as JSON (numbers, true, false, null, lists, quoted strings), else as text."""
    env, _, query = path.partition("?")
    env_args: dict[str, Any] = {}
    for pair in filter(None, query.split("&")):
        name, eq, raw = pair.partition("=")
        if not eq or not name:
            raise ValueError(f"{pair!r} is not key=value")
        value = unquote(raw)
        try:
            env_args[unquote(name)] = json.loads(value)
        except json.JSONDecodeError:
            env_args[unquote(name)] = value
    return env, env_args


def read_taskset(path: str, split: str | None = None,
                 key: str = "master.taskset") -> list[dict[str, Any]]:
    """The taskset reader `verifiers` (`<taskset>.reader: verifiers`): the rows of a verifiers
    environment's dataset, each a rollout input (`prompt` as chat messages, `answer`, `info`,
    `example_id`) that the `verifiers` workflow rolls out as it is.

    `path` names the environment as the workflow's `env` does, with its `load_environment`
    arguments as a query: `my-env?num_train_examples=500&difficulty="hard"` (the same as the
    workflow's `env_args`, or the rows are another environment's). `split`: train (the
    default; `get_dataset()`) or eval (`get_eval_dataset()`). ConfigError naming `key`."""
    try:
        env, env_args = parse_source(path)
    except ValueError as exc:
        raise ConfigError([f"{key}.path {path!r}: {exc}; write env?key=value&key=value"]) from None
    split = split or "train"
    if split not in ("train", "eval"):
        raise ConfigError([f"{key}.split: {split!r}; a verifiers environment has train and "
                           "eval"])
    try:
        environment = load_environment(env, env_args, where=f"{key}.path")
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    try:
        data = environment.get_dataset() if split == "train" else environment.get_eval_dataset()
    except ValueError as exc:  # no dataset of that split
        raise ConfigError([f"{key}.path: environment {env!r} has no {split} dataset: "
                           f"{exc}"]) from None
    rows = [dict(row) for row in data]
    missing = [n for n, row in enumerate(rows, 1) if "prompt" not in row]
    if missing:
        raise ConfigError([f"{key}.path: rows {missing[:5]} of environment {env!r} have no "
                           "prompt"])
    return rows
