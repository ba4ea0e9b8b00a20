"""The `weights` section: how published weights are written, kept and broadcast.

The wait limit of every weight transfer is `sync.timeout` (docs/design.md §4), not a key of this section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Section


class WeightsConfig(Section):
    """Weight publishing (checkpoint files) and broadcast (process group) settings."""

    keep_versions: int = Field(
        default=3, ge=1,
        description="newest weights/v{N} folders kept on disk; older ones are deleted once no "
                    "explorer is using them")
    shard_bytes: int = Field(
        default=2 * 2**30, ge=2**20,
        description="largest safetensors shard of a checkpoint version")
    verify_checksums: bool = Field(
        default=True,
        description="check every shard's xxh3 checksum before loading a version (one pass over "
                    "the bytes, which also warms the page cache for the load)")
    bucket_bytes: int = Field(
        default=512 * 2**20, ge=2**16,
        description="broadcast bucket size: tensors of one dtype are flattened into buckets of "
                    "at most this many bytes, one collective per bucket (a larger tensor goes "
                    "alone)")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="auto: nccl when the trainer and every member are on CUDA, gloo otherwise")
    rendezvous_host: str = Field(
        default="127.0.0.1",
        description="address explorers reach the trainer's group store at (the group's "
                    "rendezvous; Curve-authenticated, tandem.weights.store)")
    rendezvous_port: int = Field(
        default=0, ge=0, le=65535, description="group store port on the trainer; 0 picks a free one")
    transport: Literal["shared_fs", "fetch", "shared_memory"] = Field(
        default="shared_fs",
        description="how checkpoint versions reach explorers: shared_fs = explorers read the "
                    "trainer's run_dir/weights (one filesystem); fetch = the trainer serves the "
                    "shards at fetch_address and each explorer downloads them into its own "
                    "run_dir, checksums checked, resuming a cut transfer; shared_memory = one "
                    "host: the trainer copies each version into a /dev/shm segment and explorers "
                    "map it (no files; sync.method: checkpoint, an engine that takes tensors in "
                    "its own process)")
    fetch_address: str = Field(
        default="tcp://127.0.0.1:5580",
        description="transport fetch: the trainer's weight server (it binds this address, "
                    "explorers connect to it; give them the trainer host's name)")
    fetch_chunk_bytes: int = Field(
        default=8 * 2**20, ge=2**16, le=2**30,
        description="transport fetch: bytes per request; a cut transfer resumes at the last "
                    "whole chunk")
    fetch_window: int = Field(
        default=4, ge=1, le=64,
        description="transport fetch: chunk requests one explorer keeps in flight")
    fetch_streams: int = Field(
        default=8, ge=1, le=1024,
        description="transport fetch: explorers the trainer serves at once; the others are "
                    "answered busy and retry, so the trainer has at most fetch_streams x "
                    "fetch_window chunks in flight however many explorers fetch")
    lora_transfer: Literal["merged", "adapter"] = Field(
        default="merged",
        description="with model.lora: merged = explorers get full weights with the adapters "
                    "folded in (every engine); adapter = only the adapters, as peft adapter folders "
                    "that vLLM's LoRA API loads (engine.kind: vllm, sync.method: checkpoint, "
                    "weights.transport: shared_fs)")

    @field_validator("fetch_address")
    @classmethod
    def _tcp_address(cls, address: str) -> str:
        if not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{address!r} is not a ZeroMQ address; write tcp://HOST:PORT")
        return address

    @field_validator("rendezvous_host")
    @classmethod
    def _reachable(cls, host: str) -> str:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(
                f"{host!r} is a listen-on-all address, not one an explorer can connect to; "
                "give the trainer host's name or IP (127.0.0.1 on one machine)")
        return host
