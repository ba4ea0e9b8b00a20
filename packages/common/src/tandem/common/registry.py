"""One registry type for everything a config names: reward functions, workflows, environments,
agents, taskset readers and formats, advantage estimators, policy losses, inference engines.

An entry is registered under a name with what it declares about itself (`declares`: an engine's
capabilities, a loss's needs, a reward's isolation) and with the plugin that registered it. The
object itself may be given as `"module:attr"`, imported on first `get`: tandem's own packages
register that way, so a process that only validates a config (the master, `tandem up`) learns
every name and declaration without importing torch or a model library.

    REWARDS.register("my_reward", MyReward, isolated=True)      # or as a class decorator:
    @REWARDS.register("my_reward")
    class MyReward(PureReward): ...

A name registered twice by different objects is a `PluginError` naming both plugins; an unknown
name is a `ConfigError` naming the config key and every registered name.
"""

from __future__ import annotations

import contextvars
import importlib
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from collections.abc import Callable, Iterator

from .errors import ConfigError

T = TypeVar("T")

# The plugin whose import is running: what `register` records as an entry's origin.
_CURRENT_PLUGIN: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_plugin",
                                                                       default="<code>")


class PluginError(ConfigError):
    """A plugin failed to import or registered a name that another plugin already holds."""


def current_plugin() -> str:
    return _CURRENT_PLUGIN.get()


def plugin_scope(name: str) -> contextvars.Token:
    """Mark registrations from here on as coming from plugin `name`; reset with the token."""
    return _CURRENT_PLUGIN.set(name)


def reset_plugin_scope(token: contextvars.Token) -> None:
    _CURRENT_PLUGIN.reset(token)


@dataclass
class Entry(Generic[T]):
    """One registered item: the object (or its `module:attr` until first use), its
    declarations and the plugin that registered it."""

    name: str
    target: Any
    plugin: str
    declares: dict[str, Any] = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        return not isinstance(self.target, str)

    def resolve(self) -> T:
        if isinstance(self.target, str):
            module, _, attr = self.target.partition(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
            self.target = obj
        return self.target


def import_address(spec: str, where: str, expected: str = "'package.module:attr'") -> Any:
    """The object `"package.module:attr"` names (`attr` may be dotted); a ValueError naming
    `where` and what was `expected` when it is malformed, cannot be imported, or is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{where} {spec!r}: expected {expected}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where} {spec!r}: cannot import {module_name}: {exc}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{where} {spec!r}: {module_name} has no {attr}")
    return obj


def _address(obj: Any) -> str | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else None


class Registry(Generic[T]):
    """Items of one kind by name; `config_key` is where a run config names them."""

    def __init__(self, kind: str, config_key: str, *,
                 on_resolve: Callable[[str, Any], None] | None = None):
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, Entry[T]] = {}
        self._on_resolve = on_resolve

    def register(self, name: str, obj: T | str | None = None, /, **declares: Any) -> Any:
        """Register `obj` (or, used as a decorator, the decorated object) under `name`."""
        if not name or not isinstance(name, str):
            raise PluginError([f"{self.config_key}: a {self.kind} needs a non-empty name "
                               f"(plugin {current_plugin()})"])
        if obj is None:
            def add(target: T) -> T:
                self._add(name, target, declares)
                return target
            return add
        self._add(name, obj, declares)
        return obj

    def _add(self, name: str, target: Any, declares: dict[str, Any]) -> None:
        plugin = current_plugin()
        old = self._entries.get(name)
        if old is not None:
            if old.target is target or (old.target == target and isinstance(target, str)):
                return  # the same object again (a module imported twice): nothing changes
            if isinstance(old.target, str) and old.target == _address(target):
                # the module a lazy entry points at registers its object as it loads
                old.target = target
                old.declares = {**declares, **old.declares}
                return
            if isinstance(target, str) and target == _address(old.target):
                # the same, the other way round: the module was imported first
                old.declares = {**old.declares, **declares}
                old.plugin = plugin
                return
            raise PluginError([f"{self.config_key}: {self.kind} {name!r} is registered twice, "
                               f"by {old.plugin} and by {plugin}; rename one"])
        self._entries[name] = Entry(name, target, plugin, dict(declares))

    def unregister(self, name: str) -> None:
        """Drop `name` (tests and plugins that replace their own entry)."""
        self._entries.pop(name, None)

    def entry(self, name: str, where: str | None = None) -> Entry[T]:
        """The entry for `name` without importing it; ConfigError naming `where` (default the
        registry's config key) and the registered names if there is none."""
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError([self.unknown(name, where)]) from None

    def get(self, name: str, where: str | None = None) -> T:
        """The object registered as `name`, imported on first use."""
        entry = self.entry(name, where)
        was_loaded = entry.loaded
        try:
            obj = entry.resolve()
        except (ImportError, AttributeError) as exc:
            raise PluginError([f"{where or self.config_key}: {self.kind} {name!r} of plugin "
                               f"{entry.plugin} cannot be loaded from {entry.target!r}: "
                               f"{type(exc).__name__}: {exc}"]) from None
        if not was_loaded and self._on_resolve is not None:
            self._on_resolve(name, obj)
        return obj

    def declares(self, name: str, where: str | None = None) -> dict[str, Any]:
        return self.entry(name, where).declares

    def unknown(self, name: str, where: str | None = None) -> str:
        names = ", ".join(self.names()) or "none (is the package that provides them installed?)"
        return f"{where or self.config_key}: unknown {self.kind} {name!r}; registered: {names}"

    def check(self, name: str, where: str | None = None) -> None:
        """Raise ConfigError if `name` is not registered."""
        self.entry(name, where)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, Entry[T]]]:
        return iter(sorted(self._entries.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.config_key!r}, {self.names()})"
