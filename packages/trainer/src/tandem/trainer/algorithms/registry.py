"""A name -> function registry, so configs pick algorithms by name and users can add their own."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from tandem.common.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind (advantage estimators, policy losses) by name."""

    def __init__(self, kind: str, config_key: str):
        self.kind = kind
        self.config_key = config_key
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError([f"{self.config_key}: unknown {self.kind} {name!r}; "
                               f"registered: {', '.join(self.names())}"]) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
