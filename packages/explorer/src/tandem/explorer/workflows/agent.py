"""`agent`: the user's own agent, written against OpenAI's API, rolled out through the endpoint.

The user writes `async def run(task, client: openai.AsyncOpenAI) -> float | dict` and names it
in `workflow_args.fn` ("package.module:run"). For each task, `repeat_times` episodes run
concurrently (at most `openai.max_concurrency` at once across the step), each in its own
sandboxed process (`agent_sandbox`) holding only its task, the endpoint's URL and a client
whose API key is its episode id, so the endpoint records its calls and no episode can reach
another's. The episode's calls become experiences by the rule in `openai_calls`
(docs/explorer.md#agent), all with the episode's reward.

A function that raises, runs past `workflow_args.timeout`, crashes its process, exhausts its
limits or returns something that is not a reward scores 0 with the reason in the experience's
info (counted in `tandem_explorer_agent_failures`); the explorer carries on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Awaitable, Callable

import structlog
from pydantic import Field

from tandem.common.messages.experience import Experience, Task
from tandem.common.plugins import AGENTS, registered_or_imported

from ..openai_calls import CallRecord, versions_of
from .agent_sandbox import AgentSandbox, AgentSandboxArgs
from .base import RolloutContext, Trajectory, Workflow, WorkflowArgs, make_experience

log = structlog.get_logger(__name__)


class AgentArgs(WorkflowArgs):
    fn: str = Field(description='the agent: "package.module:function", an async function '
                                "(task payload, openai.AsyncOpenAI) -> float or dict")
    timeout: float = Field(default=300.0, gt=0,
                           description="seconds one episode may run before it scores 0")
    max_retries: int = Field(default=2, ge=0,
                             description="the client's retries (a 429 when the endpoint is busy)")
    sandbox: AgentSandboxArgs = Field(default_factory=AgentSandboxArgs,
                                      description="the process each episode runs in")


@dataclass
class Episode:
    """One episode played through the endpoint under its own key: its calls and how it ended."""

    task: Task
    index: int
    reason: str = "ok"
    records: list[CallRecord] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Outcome(Episode):
    """An episode and what it scored."""

    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)


async def play_episode(episode: Episode, endpoint: Any, gate: asyncio.Semaphore, openai: Any,
                       args: Any, play: Callable[[Any], Awaitable[Any]]) -> Any:
    """`play(client)` as `episode` in this process (the `gym` and `verifiers` workflows, whose
    loops are tandem's own; `agent` episodes run in `AgentSandbox`), with an OpenAI client
    holding that episode's key alone and
    `args.timeout` / `args.max_retries`; its result, or None when it ran past the timeout or
    raised (the reason is set: the episode scores 0). The endpoint's records of the episode's
    calls are kept whatever happened."""
    async with gate:
        key = endpoint.calls.open()
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=key,
                                    max_retries=args.max_retries, timeout=args.timeout)
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(play(client), args.timeout)
        except TimeoutError:
            episode.reason = f"timeout: ran past workflow_args.timeout = {args.timeout:g}s"
        except Exception as exc:
            episode.reason = f"raised {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            episode.seconds = time.monotonic() - t0
            episode.records = endpoint.calls.close(key)
            await client.close()
    return None


def load_agent(spec: str) -> Callable[..., Any]:
    """The async function `spec` names: an agent a plugin registered (`AGENTS`), or
    "package.module:function"."""
    fn = registered_or_imported(AGENTS, spec, "workflow_args.fn", "'package.module:function'")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"workflow_args.fn {spec!r} must be an async function "
                         "(async def run(task, client))")
    return fn


def address_of(fn: Callable[..., Any], spec: str) -> str:
    """"module:qualified.name" of `fn`, the way an episode's process imports it."""
    if "<locals>" in fn.__qualname__ or fn.__module__ in (None, "__main__"):
        raise ValueError(f"workflow_args.fn {spec!r} must be a module-level function of an "
                         "importable module: each episode imports it in its own process")
    return f"{fn.__module__}:{fn.__qualname__}"


def score_of(result: Any) -> tuple[float, dict[str, float], str]:
    """(reward, components, reason) from what an agent returned; garbage scores 0."""
    def number(x: Any) -> float | None:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            return None
        return float(x)

    if isinstance(result, dict):
        reward = number(result.get("reward"))
        if reward is None:
            return 0.0, {}, (f"returned a dict without a finite numeric 'reward' "
                             f"(keys {sorted(map(str, result))[:8]})")
        parts = {str(k): v for k, v in ((k, number(v)) for k, v in result.items())
                 if v is not None}
        return reward, parts, "ok"
    reward = number(result)
    if reward is None:
        return 0.0, {}, f"returned {type(result).__name__} {str(result)[:80]!r}, not a reward"
    return reward, {"reward": reward}, "ok"


def checked(endpoint: Any, experience: Experience, records: list[CallRecord]) -> Experience:
    """`experience`, after checking it is token for token what the engine was given and
    produced for `records` (`openai_calls.token_mismatch`): a mismatch is counted
    (`tandem_explorer_token_mismatches`), logged and marked in `info["token_mismatch"]`."""
    why = endpoint.calls.check(experience.tokens.tolist(), experience.prompt_len,
                               experience.action_mask.tolist(), experience.logprobs.tolist(),
                               records)
    if why is not None:
        experience.info["token_mismatch"] = why
        log.error("agent.token_mismatch", experience=experience.id, why=why)
    return experience


def episode_rows(episodes: list[Any]) -> list[tuple[Any, Trajectory, str, list[CallRecord]]]:
    """(episode, trajectory, rule, the records it was built from) of each of `episodes`'
    trajectories, in order."""
    rows = []
    for episode in episodes:
        trajs, rule = trajectories(episode.records)
        for k, traj in enumerate(trajs):
            rows.append((episode, traj, rule,
                         episode.records if rule == "chained" else [episode.records[k]]))
    return rows


def trajectories(records: list[CallRecord]) -> tuple[list[Trajectory], str]:
    """Trajectories of one episode by the rule above, and which way it went
    ("chained", "per_call" or "empty")."""
    if not records:
        return [], "empty"
    chained = True
    for prev, rec in itertools.pairwise(records):
        done = prev.prompt_ids + prev.token_ids
        if rec.prompt_ids[:len(done)] != done:
            chained = False
            break
    if chained:
        traj = Trajectory(list(records[0].prompt_ids))
        traj.add(records[0].token_ids, records[0].logprobs, action=True)
        for rec in records[1:]:
            traj.add(rec.prompt_ids[len(traj.tokens):], action=False)
            traj.add(rec.token_ids, rec.logprobs, action=True)
        return [traj], "chained"
    out = []
    for rec in records:
        traj = Trajectory(list(rec.prompt_ids))
        traj.add(rec.token_ids, rec.logprobs, action=True)
        out.append(traj)
    return out, "per_call"


class Agent(Workflow):
    """Episodes of a user's OpenAI-client agent; see the module docstring."""

    Args = AgentArgs

    def __init__(self, tokenizer: Any, args: dict[str, Any] | None = None):
        super().__init__(tokenizer, args)
        self.fn = load_agent(self.args.fn)
        self.address = address_of(self.fn, self.args.fn)
        self.failures: Counter[str] = Counter()  # failed episodes by the first word of the reason

    def attach(self, endpoint: Any, *, repeat_times: int, tracer: Any = None,
               metrics: Any = None) -> None:
        if metrics is not None:
            metrics.gauge_fn("agent_failures", "agent episodes that scored 0 for a failure, by "
                             "kind: timeout, memory, cpu, crashed, raised, returned (running "
                             "totals)", lambda: dict(self.failures), labels=("kind",))

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        endpoint = ctx.endpoint
        if endpoint is None or not endpoint.url:
            raise RuntimeError("the agent workflow needs the explorer's OpenAI endpoint running")
        start = time.time()
        outcomes = await self.play(tasks, ctx)
        for o in outcomes:
            if o.reason != "ok":
                self.failures[o.reason.split(":")[0].split()[0]] += 1
                log.warning("agent.episode_failed", task=o.task.id, episode=o.index,
                            reason=o.reason)
        return self.experiences(tasks, outcomes, ctx, time.time() - start)

    async def play(self, tasks: list[Task], ctx: RolloutContext) -> list[Outcome]:
        """Every episode of `tasks`, each in its own sandboxed process."""
        if importlib.util.find_spec("openai") is None:
            raise RuntimeError("the agent workflow needs the openai package: "
                               "pip install 'tandem-explorer[agent]'")
        endpoint = ctx.endpoint
        slots = endpoint.config.max_concurrency
        sandbox = AgentSandbox(self.address, self.args.sandbox, timeout=self.args.timeout,
                               max_retries=self.args.max_retries, slots=slots)
        gate = asyncio.Semaphore(slots)
        episodes: list[asyncio.Future] = []
        try:
            await sandbox.start()
            episodes = [asyncio.ensure_future(self._sandboxed(sandbox, gate, endpoint, task, k))
                        for task in tasks for k in range(ctx.repeat_times)]
            return await asyncio.gather(*episodes)
        finally:
            # every episode ends before the sandbox closes: one that failed or a cancellation
            # must not leave others running in a closed sandbox, or starting it again
            for episode in episodes:
                episode.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            await sandbox.close()

    @staticmethod
    async def _sandboxed(sandbox: AgentSandbox, gate: asyncio.Semaphore, endpoint: Any,
                         task: Task, index: int) -> Outcome:
        out = Outcome(task, index)
        async with gate:
            key = endpoint.calls.open()
            t0 = time.monotonic()
            try:
                played = await sandbox.play(key, endpoint.url, dict(task.payload))
            finally:
                out.seconds = time.monotonic() - t0
                out.records = endpoint.calls.close(key)
        if played.reason == "ok":
            out.reward, out.components, out.reason = score_of(played.result)
        else:
            out.reason = played.reason
        return out

    def experiences(self, tasks: list[Task], outcomes: list[Outcome], ctx: RolloutContext,
                    wall: float) -> list[Experience]:
        """The experiences of `outcomes` by the rule above, grouped per task in order."""
        endpoint = ctx.endpoint
        experiences: list[Experience] = []
        for task in tasks:
            mine = [o for o in outcomes if o.task is task]
            rows = episode_rows(mine)
            if not rows:
                log.warning("agent.task_without_calls", task=task.id,
                            reasons=sorted({o.reason for o in mine}))
            for index, (o, traj, rule, records) in enumerate(rows):
                experiences.append(checked(endpoint, make_experience(
                    task, index, traj, ctx, reward=o.reward,
                    rewards=o.components or {"reward": o.reward},
                    info={"group_size": len(rows), "episode": o.index, "rule": rule,
                          "reward_reason": o.reason, "calls": len(o.records),
                          "call_versions": versions_of(o.records),
                          "finish_reasons": [r.finish_reason for r in o.records],
                          "episode_s": o.seconds, "rollout_s": wall}), records))
        return experiences
