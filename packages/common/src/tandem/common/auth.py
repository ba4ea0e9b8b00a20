"""CurveZMQ with a ZAP authenticator: only clients whose public key is allowed may connect."""

from __future__ import annotations

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from .config.transport import CurveConfig

_authenticators: dict[int, AsyncioAuthenticator] = {}


class _AllowedKeys:
    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return zmq.utils.z85.encode(key) in self.keys if len(key) == 32 else key in self.keys


def start_authenticator(context: zmq.Context, curve: CurveConfig) -> AsyncioAuthenticator:
    """Start (once per context) a ZAP handler accepting the configured client keys."""
    existing = _authenticators.get(id(context))
    if existing is not None:
        return existing
    allowed = {k.encode() for k in (curve.allowed_clients or [])} | {curve.client_public.encode()}
    auth = AsyncioAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(allowed))
    _authenticators[id(context)] = auth
    return auth


def stop_authenticators() -> None:
    for auth in _authenticators.values():
        auth.stop()
    _authenticators.clear()


def generate_keypair() -> tuple[str, str]:
    """(public, secret) Z85 strings for a config file."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()
