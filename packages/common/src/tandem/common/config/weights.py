"""The `weights` section: how published weights are written, kept and broadcast."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class WeightsConfig(Section):
    """Weight publishing (checkpoint files) and broadcast (process group) settings."""

    keep_versions: int = Field(default=3, ge=1, description="weights/v{N} folders kept on disk")
    bucket_bytes: int = Field(default=512 * 2**20, ge=1, description="broadcast bucket size")
    shard_bytes: int = Field(default=2 * 2**30, ge=1, description="largest safetensors shard")
    rendezvous_host: str = Field(default="127.0.0.1", description="TCPStore host of the group")
