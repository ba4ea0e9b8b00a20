"""The `buffer` section: store location, capacity, sampling policy, leases, retention."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class BufferConfig(Section):
    """The durable experience store and how the trainer samples from it."""

    address: str = Field(default="tcp://127.0.0.1:5560", description="RPC (ROUTER) address")
    db: str = Field(default="buffer.sqlite", description="SQLite file, relative to the run dir")
    capacity: int = Field(
        default=1_000_000, ge=1,
        description="unconsumed experiences (waiting, ready, leased) held at most; a put beyond "
                    "it is answered 'full' with retry_after")
    retry_after: float = Field(
        default=0.5, gt=0, description="seconds a 'full' answer tells the explorer to wait")
    policy: Literal["fifo", "newest", "priority"] = Field(
        default="fifo",
        description="default sampling order: fifo = oldest version first, newest = newest "
                    "version first, priority = highest group priority first")
    priority: Literal["reward_variance", "advantage", "key"] = Field(
        default="reward_variance",
        description="what a group's priority is: variance of its rewards, mean |advantage| "
                    "(info['advantage'] or reward minus the group mean), or mean of "
                    "info[priority_key]")
    priority_key: str | None = Field(
        default=None, description="info key averaged over the group when priority is 'key'")
    lease_seconds: float = Field(
        default=120.0, gt=0, description="before a lease returns its groups")
    reuse: int = Field(default=1, ge=1, description="times a group may be trained on (replay)")
    keep_consumed: int = Field(
        default=0, ge=0,
        description="consumed (or stale) experiences whose rows are kept for inspection, newest "
                    "first; older ones are deleted, so the database stays bounded")
    synchronous: Literal["full", "normal"] = Field(
        default="full",
        description="full: every commit that stores experiences is fsynced before the put is "
                    "answered (survives power loss); lease and ack commits are not (a power loss "
                    "may serve a group once more, never lose one). normal: nothing is fsynced, "
                    "everything survives a process crash only")
    commit_batch: int = Field(
        default=256, ge=1, description="requests folded into one commit at most (group commit)")
    max_sample_wait: float = Field(
        default=60.0, gt=0,
        description="seconds a sample request may wait for groups at most, whatever its `wait` "
                    "and time-to-live ask; then it is answered not_enough and the trainer asks "
                    "again")
    max_parked_per_client: int = Field(
        default=2, ge=1,
        description="sample requests one client may have waiting at once; a newer one answers "
                    "that client's oldest waiting sample not_enough at once, so a client that "
                    "floods or re-sends holds at most this many")

    @model_validator(mode="after")
    def _priority_key_given(self) -> BufferConfig:
        if self.priority == "key" and not self.priority_key:
            raise ValueError("buffer.priority: 'key' needs buffer.priority_key, the info field "
                             "to rank groups by; set it or choose another priority")
        return self
