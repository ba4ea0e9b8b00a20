"""`verifiers`: an environment in the `verifiers` format (the Environments Hub's), run unchanged.

`workflow_args.env` names it (an environment id, or "package.module:function"; see
`verifiers_loader.load_environment`) and `env_args` are its `load_environment` arguments. Its
dataset is the taskset (the taskset reader `verifiers` reads it; each task's payload is one of
its rows). For each task, `repeat_times` rollouts run the environment's own `rollout` (single
turn, multi turn, tools: whatever it does), each with a verifiers client pointed at the
explorer's OpenAI endpoint under its own episode id, so the endpoint records the exact token
ids, logprobs and policy version of every call, as for the `agent` workflow. The task's group is
then scored by the environment's rubric (`rubric.score_group`: group reward functions see the
whole group), and each rollout's calls become experiences by the `agent` workflow's rule
(chained into one, else one per call) with the rubric's reward and its named metrics.

A rollout that raises, runs past `workflow_args.timeout`, or ends with an error verifiers
recorded (the model's answer was empty, the endpoint refused the call) scores 0 with the reason
in the experience's info; the explorer carries on.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import Field

from tandem.common.messages.experience import Experience, Task

from ..openai_calls import versions_of
from ..verifiers_loader import import_verifiers, load_environment
from .agent import Episode, checked, episode_rows, play_episode
from .base import RolloutContext, Workflow, WorkflowArgs, make_experience

log = structlog.get_logger(__name__)


class VerifiersArgs(WorkflowArgs):
    env: str = Field(description='the verifiers environment: its id (an installed module, as '
                                 'vf.load_environment takes it) or "package.module:function"')
    env_args: dict[str, Any] = Field(default_factory=dict,
                                     description="keyword arguments of its load_environment")
    sampling_args: dict[str, Any] = Field(
        default_factory=dict, description="sent with every call, over the environment's own "
                                          "sampling_args; unset ones are the explorer's sampling")
    timeout: float = Field(default=600.0, gt=0,
                           description="seconds one rollout may run before it scores 0")
    max_retries: int = Field(default=2, ge=0,
                             description="the client's retries (a 429 when the endpoint is busy)")


@dataclass
class _Rollout(Episode):
    state: Any = None  # the environment's State, None if the rollout raised


class Verifiers(Workflow):
    """Rollouts of a verifiers environment, scored by its rubric; see the module docstring."""

    Args = VerifiersArgs

    def __init__(self, tokenizer: Any, args: dict[str, Any] | None = None):
        super().__init__(tokenizer, args)
        self.vf = import_verifiers("workflow_args.env")
        self.env = load_environment(self.args.env, self.args.env_args)

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        endpoint = ctx.endpoint
        if endpoint is None or not endpoint.url:
            raise RuntimeError("the verifiers workflow needs the explorer's OpenAI endpoint "
                               "running")
        for task in tasks:
            if "prompt" not in task.payload:
                raise ValueError(f"task {task.id!r} has no 'prompt' (has {sorted(task.payload)}):"
                                 " read the taskset with master.taskset reader verifiers, or "
                                 "export the environment's get_dataset() rows")
        import openai

        gate = asyncio.Semaphore(endpoint.config.max_concurrency)
        start = time.time()
        groups = await asyncio.gather(*(self._group(openai, endpoint, gate, task,
                                                    ctx.repeat_times) for task in tasks))
        wall = time.time() - start
        experiences: list[Experience] = []
        for task, rollouts in zip(tasks, groups):
            rows = episode_rows(rollouts)
            if not rows:
                log.warning("verifiers.task_without_calls", task=task.id,
                            reasons=sorted({r.reason for r in rollouts}))
            for index, (r, traj, rule, records) in enumerate(rows):
                reward, components = self._score(r)
                state = r.state or {}
                experiences.append(checked(endpoint, make_experience(
                    task, index, traj, ctx, reward=reward, rewards=components,
                    info={"group_size": len(rows), "env": self.args.env, "episode": r.index,
                          "rule": rule, "reward_reason": r.reason, "calls": len(r.records),
                          "turns": len(state.get("trajectory") or ()),
                          "stop_condition": state.get("stop_condition"),
                          "is_truncated": bool(state.get("is_truncated")),
                          "call_versions": versions_of(r.records),
                          "finish_reasons": [c.finish_reason for c in r.records],
                          "episode_s": r.seconds, "rollout_s": wall}), records))
        return experiences

    @staticmethod
    def _score(r: _Rollout) -> tuple[float, dict[str, float]]:
        """The rubric's reward and its metrics by name; 0 for a rollout that failed."""
        metrics = {}
        if r.state is not None:
            metrics = {str(k): float(v) for k, v in (r.state.get("metrics") or {}).items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if r.reason != "ok" or r.state is None or r.state.get("reward") is None:
            return 0.0, {**metrics, "reward": 0.0}
        reward = float(r.state["reward"])
        return reward, {**metrics, "reward": reward}

    async def _group(self, openai: Any, endpoint: Any, gate: asyncio.Semaphore, task: Task,
                     n: int) -> list[_Rollout]:
        rollouts = [_Rollout(task, k) for k in range(n)]
        await asyncio.gather(*(self._rollout(openai, endpoint, gate, r) for r in rollouts))
        scored = [r for r in rollouts if r.state is not None]
        if scored:
            # the rubric scores the group together, as verifiers' own run_group does
            states = [r.state for r in scored]
            try:
                if self.env.score_rollouts:
                    await self.env.rubric.score_group(states)
                else:
                    await self.env.rubric.dummy_score_group(states)
                for state in states:
                    await self.env.rubric.cleanup(state)
            except Exception as exc:
                for r in scored:
                    r.reason = f"rubric raised {type(exc).__name__}: {str(exc)[:200]}"
        for r in rollouts:
            if r.reason != "ok":
                log.warning("verifiers.rollout_failed", task=task.id, episode=r.index,
                            reason=r.reason)
        return rollouts

    async def _rollout(self, openai: Any, endpoint: Any, gate: asyncio.Semaphore,
                       r: _Rollout) -> None:
        sampling = {**copy.deepcopy(self.env.sampling_args), **self.args.sampling_args}

        def play(client: Any) -> Any:
            return self.env.rollout(copy.deepcopy(dict(r.task.payload)),
                                    self.vf.OpenAIChatCompletionsClient(client),
                                    endpoint.config.model, sampling)

        r.state = await play_episode(r, endpoint, gate, openai, self.args, play)
        error = r.state.get("error") if r.state is not None else None
        if error is not None:
            cause = error.__cause__ or error
            r.reason = f"error: {type(error).__name__}: {str(cause)[:200]}"
