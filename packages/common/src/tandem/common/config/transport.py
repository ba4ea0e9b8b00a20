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
    def _keys_are_z85(self) -> CurveConfig:
        for name in ("server_public", "server_secret", "client_public", "client_secret"):
            if len(getattr(self, name)) != 40:
                raise ValueError(f"transport.curve.{name} must be a 40-character Z85 key")
        return self


class TransportConfig(Section):
    """How components talk: limits that bound what a peer can make a component allocate."""

    max_message_bytes: int = Field(default=2**31, ge=1024, description="largest accepted message")
    max_frames: int = Field(
        default=16384, ge=2, description="most frames in one message (frame 0 plus one per "
                                         "large array); the rest of a longer one is discarded "
                                         "unread and the message refused")
    max_items: int = Field(
        default=65536, ge=16, description="most items in any one list or map of a message; "
                                          "message types bound their own lists further, e.g. "
                                          "reward.max_batch")
    max_depth: int = Field(default=32, ge=4, le=1000,
                           description="deepest nesting of lists and maps in a message")
    inline_threshold: int = Field(
        default=16384, ge=0, description="arrays at or above this many bytes travel as own frames")
    hwm: int = Field(default=10000, ge=0, description="ZeroMQ high-water mark, messages")
    rpc_timeout: float = Field(default=30.0, gt=0, description="default seconds for an RPC reply")
    rpc_retries: int = Field(default=2, ge=0, description="resends (same id) after a timeout")
    heartbeat_interval: float = Field(default=1.0, gt=0, description="seconds between heartbeats")
    liveness: float = Field(default=10.0, gt=0, description="seconds of silence before a peer is dead")
    curve: CurveConfig | None = None


SECRET_KEYS = ("server_secret", "client_secret")


def move_secrets_to_env(data: dict) -> dict[str, str]:
    """Replace the Curve secret keys and remote engines' API keys of a dumped run config
    (`model_dump(mode="json")`) by `${env:TANDEM_CURVE_...}` / `${env:TANDEM_ENGINE_API_KEY_i}`
    references, in place, and return those variables with the keys.

    `tandem up` writes the config it gives its children into the run dir and hands them the
    secrets through their environment instead, so no secret reaches the disk."""
    curve = (data.get("transport") or {}).get("curve")
    env: dict[str, str] = {}
    for key in SECRET_KEYS if curve else ():
        var = f"TANDEM_CURVE_{key.upper()}"
        env[var] = curve[key]
        curve[key] = f"${{env:{var}}}"
    for i, explorer in enumerate(data.get("explorers") or ()):
        engine = explorer.get("engine") or {}
        if engine.get("api_key"):  # a remote engine's server key
            var = f"TANDEM_ENGINE_API_KEY_{i}"
            env[var] = engine["api_key"]
            engine["api_key"] = f"${{env:{var}}}"
    return env

