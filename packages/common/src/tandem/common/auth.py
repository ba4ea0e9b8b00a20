"""CurveZMQ with a ZAP authenticator: only clients whose public key is allowed may connect."""

from __future__ import annotations

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator

from .config.transport import CurveConfig

_authenticators: dict[int, AsyncioAuthenticator | ThreadAuthenticator] = {}


class _AllowedKeys:
    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return zmq.utils.z85.encode(key) in self.keys if len(key) == 32 else key in self.keys


def start_authenticator(context: zmq.Context, curve: CurveConfig
                        ) -> AsyncioAuthenticator | ThreadAuthenticator:
    """Start (once per context) a ZAP handler accepting the configured client keys: on the
    event loop for an asyncio context, on a thread of its own for a blocking one (the weight
    group's store, served from the trainer's broadcast threads)."""
    existing = _authenticators.get(id(context))
    if existing is not None:
        return existing
    allowed = {k.encode() for k in (curve.allowed_clients or [])} | {curve.client_public.encode()}
    asyncio_context = isinstance(context, zmq.asyncio.Context)
    auth = AsyncioAuthenticator(context) if asyncio_context else ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(allowed))
    _authenticators[id(context)] = auth
    return auth


def stop_authenticator(context: zmq.Context) -> None:
    """Stop the ZAP handler of one context (before the context is terminated)."""
    auth = _authenticators.pop(id(context), None)
    if auth is not None:
        auth.stop()


def stop_authenticators() -> None:
    for auth in _authenticators.values():
        auth.stop()
    _authenticators.clear()


def generate_keypair() -> tuple[str, str]:
    """(public, secret) Z85 strings for a config file."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()
