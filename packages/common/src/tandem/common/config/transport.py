"""The `transport` section: socket limits and optional CurveZMQ keys."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import Section


class CurveConfig(Section):
    """CurveZMQ keys (Z85 strings; use ${env:VAR} for secrets). All set or none."""

    server_public: str = Field(description="public key every server socket presents")
    server_secret: str = Field(description="secret key of the server sockets")
    client_public: str = Field(description="this component's client public key")
    client_secret: str = Field(description="this component's client secret key")
    allowed_clients: list[str] = Field(
        default_factory=list, description="client public keys a server accepts; empty = own key only")

    @model_validator(mode="after")
    def _keys_are_z85(self) -> "CurveConfig":
        for name in ("server_public", "server_secret", "client_public", "client_secret"):
            if len(getattr(self, name)) != 40:
                raise ValueError(f"transport.curve.{name} must be a 40-character Z85 key")
        return self


class TransportConfig(Section):
    """How components talk: limits that bound what a peer can make a component allocate."""

    max_message_bytes: int = Field(default=2**31, ge=1024, description="largest accepted message")
    inline_threshold: int = Field(
        default=16384, ge=0, description="arrays at or above this many bytes travel as own frames")
    hwm: int = Field(default=10000, ge=0, description="ZeroMQ high-water mark, messages")
    rpc_timeout: float = Field(default=30.0, gt=0, description="default seconds for an RPC reply")
    rpc_retries: int = Field(default=2, ge=0, description="resends (same id) after a timeout")
    heartbeat_interval: float = Field(default=1.0, gt=0, description="seconds between heartbeats")
    liveness: float = Field(default=10.0, gt=0, description="seconds of silence before a peer is dead")
    curve: CurveConfig | None = None
