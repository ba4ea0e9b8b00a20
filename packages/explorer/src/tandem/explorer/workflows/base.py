"""What a workflow is: tasks in, experiences out, through an engine and a reward scorer."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar
from collections.abc import Awaitable, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from tandem.common.messages.experience import Experience, Task, repeat_id, task_group_id

from ..engine import Engine
from ..rewards import RewardScorer
from ..sampling import SamplingParams


@dataclass
class RolloutContext:
    """Everything a workflow needs for one explorer step."""

    engine: Engine
    sampling: SamplingParams
    repeat_times: int
    explorer: str
    run: str = "local"  # the master's run id: with a task's epoch and id, it names its group
    step: int = 0
    scorer: RewardScorer | None = None
    version: int | None = None  # defaults to the engine's
    endpoint: Any = None  # the explorer's OpenAI endpoint (openai_server), when it serves one
    # streaming rollouts: awaited with each task's group as soon as it is scored, while the
    # others still generate (a workflow that cannot stream leaves it to the caller)
    on_group: Callable[[list[Experience]], Awaitable[None]] | None = None

    @property
    def policy_version(self) -> int:
        return self.engine.version if self.version is None else self.version


class WorkflowArgs(BaseModel):
    """Base of each workflow's `workflow_args`; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Workflow(ABC):
    """Turns a batch of tasks into experiences: `repeat_times` per task, one group per task."""

    Args: ClassVar[type[WorkflowArgs]] = WorkflowArgs

    def __init__(self, tokenizer: Any, args: dict[str, Any] | None = None):
        try:
            self.args = self.Args.model_validate(args or {})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                                 for e in exc.errors())
            raise ValueError(f"workflow_args for {type(self).__name__}: {problems}") from None
        self.tokenizer = tokenizer

    def attach(self, endpoint: Any, *, repeat_times: int, tracer: Any = None,
               metrics: Any = None) -> None:
        """Called once by the explorer that runs it, after it built its OpenAI endpoint (None
        without one) and before the endpoint serves: a workflow that takes traffic of its own
        (`online`) adds its routes, metrics and trace events here."""

    @abstractmethod
    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        """Roll out every task `ctx.repeat_times` times; experiences grouped per task, in order."""


@dataclass
class Trajectory:
    """The tokens of one sampled response or episode, before it becomes an experience."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # None: not known per token
    images: list[str] = field(default_factory=list)  # content hashes of the prompt's images

    def add(self, ids, logprobs=None, *, action: bool, versions=None) -> None:
        """Append response tokens; `versions`: the weights version that sampled each (a
        completion's `token_versions`, from an interruptible engine)."""
        ids = [int(t) for t in ids]
        self.response_ids += ids
        self.action_mask += [1 if action else 0] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)
        self.versions += ([int(v) for v in versions[:len(ids)]] if versions is not None
                          else [None] * len(ids))

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def make_experience(task: Task, index: int, traj: Trajectory, ctx: RolloutContext, *,
                    reward: float, rewards: dict[str, float], info: dict[str, Any]) -> Experience:
    """An experience per docs/design.md §3, with the group size the buffer needs to close a group.

    Its version is the oldest that sampled one of its tokens; per-token versions are kept when
    they are not all that one (weights loaded mid-generation). `settle_group_versions` then
    gives the whole group its oldest version.
    """
    version = ctx.policy_version
    known = [v for v, a in zip(traj.versions, traj.action_mask) if v is not None and a]
    token_versions = None
    if known:
        version = min(known)
        filled = [version if v is None or not a else v
                  for v, a in zip(traj.versions, traj.action_mask)]
        if any(v != version for v in filled):
            token_versions = np.asarray(filled, dtype=np.int32)
    group = task_group_id(ctx.run, task.epoch, task.id)
    return Experience(
        id=repeat_id(group, index),
        task_id=task.id,
        group_id=group,
        tokens=np.asarray(traj.tokens, dtype=np.int32),
        prompt_len=len(traj.prompt_ids),
        action_mask=np.asarray(traj.action_mask, dtype=np.uint8),
        logprobs=np.asarray(traj.logprobs, dtype=np.float32),
        reward=float(reward),
        rewards={k: float(v) for k, v in rewards.items()},
        policy_version=version,
        token_versions=token_versions,
        images=list(traj.images),
        explorer=ctx.explorer,
        created_at=time.time(),
        info={"group_size": ctx.repeat_times, "repeat_index": index, "step": ctx.step,
              "epoch": task.epoch, "sampling": ctx.sampling.describe(), **info},
    )


def settle_group_versions(experiences: list[Experience]) -> list[Experience]:
    """One `policy_version` per group, its oldest: a response sampled after new weights arrived
    (later in an interrupted batch) keeps its own version per token. Groups in any order."""
    oldest: dict[str, int] = {}
    for e in experiences:
        oldest[e.group_id] = min(oldest.get(e.group_id, e.policy_version), e.policy_version)
    return [e if e.policy_version == oldest[e.group_id] else
            e.model_copy(update={"policy_version": oldest[e.group_id],
                                 "token_versions": e.versions_of_tokens()})
            for e in experiences]
