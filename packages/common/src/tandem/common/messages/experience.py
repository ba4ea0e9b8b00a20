"""The experience (docs/design.md §3): one sampled response, or one multi-turn episode, to one task."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .base import Array


def task_group_id(run: str, epoch: int, task_id: str) -> str:
    """The group of one task's responses, named by the task's place in the run (run, epoch,
    task): whoever rolls the task out, and with whichever weights, fills the same group, so a
    task leased again after its explorer died stores nothing new (docs/design.md §3 as of issue 14)."""
    run_key = hashlib.blake2b(run.encode(), digest_size=4).hexdigest()
    return f"{task_id}@e{epoch}.{run_key}"


def repeat_id(group: str, repeat_index: int) -> str:
    """An explorer's experience id: its group and its repeat index; putting it twice (a
    retried put, or the same task rolled out again) stores it once."""
    key = f"{group}\x1f{repeat_index}".encode()
    return hashlib.blake2b(key, digest_size=16).hexdigest()


def experience_id(task_id: str, repeat_index: int, policy_version: int, explorer_run: str) -> str:
    """A deterministic id for an experience made outside a run's taskset (tests, benchmarks);
    explorers use `repeat_id(task_group_id(...), index)`."""
    key = f"{task_id}\x1f{repeat_index}\x1f{policy_version}\x1f{explorer_run}".encode()
    return hashlib.blake2b(key, digest_size=16).hexdigest()


def group_id(task_id: str, policy_version: int) -> str:
    """A group id for experiences made outside a run's taskset (tests, benchmarks); explorers
    use `task_group_id`."""
    return f"{task_id}@v{policy_version}"


class Experience(BaseModel):
    """Explorer to buffer (in `buffer.put`), buffer to trainer (in `buffer.sample.reply`)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    id: str
    task_id: str
    group_id: str
    tokens: Array("int32", 1) = Field(description="prompt and response tokens")
    prompt_len: int = Field(ge=0, description="tokens[:prompt_len] is the prompt")
    action_mask: Array("uint8", 1) = Field(description="1 where the model produced the token")
    logprobs: Array("float32", 1) = Field(description="behaviour-policy logprobs of the response")
    reward: float = 0.0
    rewards: dict[str, float] = Field(default_factory=dict, description="named components")
    policy_version: int = Field(
        ge=0, description="the oldest version that produced a token of this response's group")
    token_versions: Array("int32", 1) | None = Field(
        default=None, description="the version that produced each response token; None: all "
        "of them `policy_version` (weights loaded mid-generation make it a mix)")
    images: list[str] = Field(
        default_factory=list, description="content hashes (tandem.common.images.image_hash) of "
        "the images the prompt shows, in order; their bytes travel beside the experiences, once "
        "(PutExperiences.images, SampleResult.images), and the buffer stores each once")
    explorer: str = ""
    created_at: float = Field(default_factory=time.time)
    info: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _lengths_agree(self) -> Experience:
        n = int(self.tokens.shape[0])
        if self.prompt_len > n:
            raise ValueError(f"prompt_len {self.prompt_len} exceeds {n} tokens")
        response = n - self.prompt_len
        for name in ("action_mask", "logprobs", "token_versions"):
            if getattr(self, name) is None:
                continue
            got = int(getattr(self, name).shape[0])
            if got != response:
                raise ValueError(
                    f"{name} has {got} entries but the response has {response} tokens "
                    f"({n} tokens - prompt_len {self.prompt_len})"
                )
        if self.token_versions is not None and response and \
                int(self.token_versions.min()) < self.policy_version:
            raise ValueError(f"policy_version {self.policy_version} is newer than a token's "
                             f"(token_versions min {int(self.token_versions.min())}); it is "
                             "the oldest version of the response's group")
        return self

    def versions_of_tokens(self) -> np.ndarray:
        """The version of each response token (`policy_version` throughout when not mixed)."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(self.response_len, self.policy_version, dtype=np.int32)

    @property
    def response_len(self) -> int:
        return int(self.tokens.shape[0]) - self.prompt_len

    @property
    def nbytes(self) -> int:
        extra = self.token_versions.nbytes if self.token_versions is not None else 0
        return int(self.tokens.nbytes + self.action_mask.nbytes + self.logprobs.nbytes + extra)


class Task(BaseModel):
    """One unit of work from the taskset: master to explorer inside a task lease."""

    model_config = ConfigDict(extra="forbid")
    id: str
    payload: dict[str, Any] = Field(description="the taskset row: prompt, answer, metadata")
    epoch: int = 0
