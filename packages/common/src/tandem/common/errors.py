"""Exception types that cross component boundaries as a code and a message."""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error tandem raises on purpose."""


class ProtocolError(TandemError):
    """A message could not be decoded or does not match its schema; says what and where."""


class ConfigError(TandemError):
    """A run config is invalid; `errors` lists every bad field as "path: problem"."""

    def __init__(self, errors: list[str], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        head = f"invalid config{f' {source}' if source else ''}"
        super().__init__(head + ":\n" + "\n".join(f"  {e}" for e in self.errors))


class RequestFailed(TandemError):
    """The peer answered, and the answer is an error: this request failed, the peer is alive."""

    def __init__(self, code: str, message: str, *, retry_after: float | None = None):
        self.code = code
        self.message = message
        self.retry_after = retry_after
        super().__init__(f"[{code}] {message}")


class PeerDead(TandemError):
    """The peer did not answer in time: that component is dead or unreachable. `bound`: the
    seconds it was given, resends included; `key`: the config key that set that bound."""

    def __init__(self, peer: str, message: str, *, bound: float | None = None,
                 key: str | None = None):
        self.peer = peer
        self.bound = bound
        self.key = key
        super().__init__(message)


class BindFailed(TandemError, OSError):
    """A server socket could not bind its address (in use, or not an address of this host)."""


class WaitTimeout(TandemError):
    """A wait (barrier, weights, experiences) ran past its timeout; names what and the knob."""
