"""Plugins: where a user's own task (reward, workflow, environment, agent, taskset reader or
format, advantage, loss, off-policy correction, engine) comes from, as first-class as tandem's own.

Two sources, imported in this order by every process that reads a run config:
1. installed packages, through the entry-point group `tandem.plugins` (tandem's own packages
   register their built-ins this way); an entry point names a module, imported for its
   registrations, or a function, called with no arguments;
2. the run config's `plugins: [...]`, each a module name (`my_task.plugin`) or a path to a
   `.py` file (relative paths are made absolute against the working directory, else the
   config file's folder, when the config is loaded).

Every registry lives here, in `tandem.common`, so that the config can check each name before a
process starts; the components look their items up in the same registries.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from .registry import (
    PluginError, Registry, import_address, plugin_scope, reset_plugin_scope)

ENTRY_POINT_GROUP = "tandem.plugins"


@dataclass(frozen=True)
class EngineCapabilities:
    """What an inference engine can do; config validation and the explorer read this, never
    the engine's name.

    `weights`: the paths new weights can reach it by: `broadcast` (a process group, sync.method
    nccl), `checkpoint` (files on a shared filesystem), `fetch` (files fetched from the trainer),
    `shared_memory` (segments the explorer's own process maps: a `TensorEngine`; not by default,
    since an engine whose workers load weights themselves gets no tensors from the explorer).
    """

    weights: frozenset[str] = frozenset({"broadcast", "checkpoint", "fetch"})
    interrupt: bool = False        # on_new_weights: interrupt (load mid-generation)
    lora_adapters: bool = False    # weights.lora_transfer: adapter
    multimodal: bool = False       # image inputs
    tensor_parallel: bool = False  # engine.tensor_parallel_size > 1
    needs_url: bool = False        # engine.url names the server it drives
    sleep: bool = False            # placement.colocate: releases its weights while the trainer works


@dataclass(frozen=True)
class LossNeeds:
    """What a policy loss needs from the trainer; the learner and config read this, never the
    loss's name. `params` is the pydantic model of its own config section (`trainer.loss`)."""

    reference: bool = False   # a frozen reference model's logprobs (`reference` in its inputs)
    pairs: bool = False       # rows as (chosen, rejected) pairs, one per group
    value_head: bool = False  # a value head's predictions
    advantages: bool = True   # uses the advantage estimator (false: sft, dpo)
    params: Any = None        # pydantic model (or "module:attr") of its parameters


REWARDS: Registry[Any] = Registry("reward function", "reward.functions")
WORKFLOWS: Registry[Any] = Registry("workflow", "explorers[*].workflow")
ENVIRONMENTS: Registry[Any] = Registry("environment", "explorers[*].workflow_args.env")
AGENTS: Registry[Any] = Registry("agent", "explorers[*].workflow_args.fn")
TASKSET_READERS: Registry[Any] = Registry("taskset reader", "master.taskset.reader")
TASKSET_FORMATS: Registry[Any] = Registry("taskset format", "master.taskset.format.name")
ADVANTAGES: Registry[Any] = Registry("advantage estimator", "trainer.advantage")
POLICY_LOSSES: Registry[Any] = Registry("policy loss", "trainer.loss")
CORRECTIONS: Registry[Any] = Registry("off-policy correction", "trainer.corrections[*].name")
ENGINES: Registry[Any] = Registry("inference engine", "explorers[*].engine.kind")

REGISTRIES: dict[str, Registry[Any]] = {
    "rewards": REWARDS, "workflows": WORKFLOWS, "environments": ENVIRONMENTS, "agents": AGENTS,
    "taskset_readers": TASKSET_READERS, "taskset_formats": TASKSET_FORMATS,
    "advantages": ADVANTAGES, "policy_losses": POLICY_LOSSES, "corrections": CORRECTIONS,
    "engines": ENGINES,
}

_installed_loaded = False
_loaded: dict[str, str] = {}  # plugin spec -> module name, so each is imported once


def load_installed() -> None:
    """Import every `tandem.plugins` entry point of the installed packages, once."""
    global _installed_loaded
    if _installed_loaded:
        return
    _installed_loaded = True
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        origin = f"{ep.name} ({ep.value}, entry point {ENTRY_POINT_GROUP})"
        token = plugin_scope(origin)
        try:
            loaded = ep.load()
            if callable(loaded):
                loaded()
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError([f"entry point {ENTRY_POINT_GROUP}:{ep.name}: plugin {ep.value} "
                               f"failed to import: {type(exc).__name__}: {exc}"]) from None
        finally:
            reset_plugin_scope(token)


def load_plugins(specs: Iterable[str] = (), *, key: str = "plugins") -> None:
    """The installed plugins, then each of `specs` (module names or `.py` paths), once each.

    A plugin that fails to import, or registers a name already taken, is a `PluginError`
    (a config error: exit code 2) naming `key[i]` and the plugin."""
    load_installed()
    for i, spec in enumerate(specs):
        if spec in _loaded:
            continue
        token = plugin_scope(spec)
        try:
            _loaded[spec] = _import(spec)
        except PluginError as exc:
            raise PluginError([f"{key}[{i}] ({spec}): {e}" for e in exc.errors]) from None
        except Exception as exc:
            raise PluginError([f"{key}[{i}]: plugin {spec!r} failed to import: "
                               f"{type(exc).__name__}: {exc}"]) from None
        finally:
            reset_plugin_scope(token)


def registered_or_imported(registry: Registry[Any], spec: str, where: str, address: str) -> Any:
    """What `spec` names where a config takes either: an item registered in `registry`, or
    "package.module:attr" (`address` shows that form in errors, e.g. 'package.module:EnvClass');
    a ValueError naming `where` otherwise."""
    if ":" in spec:
        return import_address(spec, where, f"{address} or a registered {registry.kind} name")
    load_installed()
    if spec not in registry:
        raise ValueError(registry.unknown(spec, where) + f", or write {address}")
    return registry.get(spec, where)


def loaded_plugins() -> list[str]:
    """The `plugins` specs this process imported, in order: what its own child processes
    (the reward workers) import too."""
    return list(_loaded)


def is_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def absolute(spec: str, config_dir: Path | None) -> str:
    """A `.py` plugin path made absolute: against the working directory if it is there, else
    the config file's folder; module names are returned unchanged."""
    if not is_path(spec) or Path(spec).is_absolute():
        return spec
    here = Path(spec).resolve()
    if here.exists() or config_dir is None:
        return str(here)
    return str((config_dir / spec).resolve())


def _import(spec: str) -> str:
    if not is_path(spec):
        return importlib.import_module(spec).__name__
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path}")
    # One module name per file, stable across processes, so pickles and logs agree.
    name = f"tandem_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return name
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"{path} is not an importable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return name


def outside_tandem(specs: Iterable[str] = ()) -> list[str]:
    """What a deployment's image or venv must hold beyond tandem itself: the config's
    `plugins` and every installed `tandem.plugins` entry point of another distribution."""
    from importlib.metadata import entry_points

    out = [f"plugin {spec} (the config's plugins)" for spec in specs]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        if not dist.startswith("tandem-"):
            out.append(f"package {dist} (entry point {ENTRY_POINT_GROUP}: {ep.name})")
    return out


__all__ = [
    "ADVANTAGES",
    "AGENTS",
    "ENGINES",
    "ENTRY_POINT_GROUP",
    "ENVIRONMENTS",
    "POLICY_LOSSES",
    "REGISTRIES",
    "REWARDS",
    "TASKSET_FORMATS",
    "TASKSET_READERS",
    "WORKFLOWS",
    "EngineCapabilities",
    "LossNeeds",
    "PluginError",
    "absolute",
    "load_installed",
    "load_plugins",
    "loaded_plugins",
    "outside_tandem",
    "registered_or_imported",
]
