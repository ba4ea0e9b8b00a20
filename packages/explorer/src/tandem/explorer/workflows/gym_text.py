"""`gym`: a Gymnasium-style text environment played by the policy, unchanged.

`workflow_args.env` names the environment ("package.module:EnvClass", or a name a plugin
registered it under in `ENVIRONMENTS`); each episode builds one with `env_args` and plays it as
a chat (`environments.gym_text.GymEpisode`): the observation of `reset` is the first user
message, each assistant message is an action, each observation of `step` the next user message,
until the environment terminates or truncates the episode or `max_turns` actions were taken.

The chat goes through the explorer's OpenAI endpoint, exactly as an `agent` episode does (it is
one: this workflow is the `agent` workflow with the episode above as its agent), so the policy's
own chat template renders each turn, its tokens are never re-tokenized, and an episode becomes
one experience: the model's turns with action mask 1, the observations and the template's turn
markers between them with mask 0. Its reward is the environment's (summed, or the last), with
the components `return`, `last`, `steps` and `terminated`. An environment that raises scores 0
with the reason in the experience's info. Unlike `agent`'s episodes, these run in the
explorer's process: the environment is code the run's config names, trusted like a plugin.

The multi-turn workflow's engine loop is not used because a chat model ends its every turn with
end-of-sequence, which that loop reads as the end of the episode; the endpoint's chat rendering
handles a turn that ends so.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from typing import Any, Literal

from pydantic import Field

from tandem.common.messages.experience import Experience, Task

from ..environments.gym_text import GymEpisode, resolve_gym_env
from .agent import Agent, Outcome, play_episode, score_of
from .base import RolloutContext, Workflow, WorkflowArgs


class GymArgs(WorkflowArgs):
    env: str = Field(description='the environment: "package.module:EnvClass" or a registered '
                                 "environment name")
    env_args: dict[str, Any] = Field(default_factory=dict,
                                     description="keyword arguments of the environment class")
    reward: Literal["sum", "last"] = Field(
        default="sum", description="the episode's reward: the sum of step rewards, or the last")
    max_turns: int = Field(default=16, ge=1, description="actions per episode")
    system: str | None = Field(default=None, description="system message before the first "
                                                         "observation")
    stop: list[str] = Field(default_factory=list,
                            description="strings that also end a model turn (besides eos)")
    timeout: float = Field(default=300.0, gt=0,
                           description="seconds one episode may run before it scores 0")
    max_retries: int = Field(default=2, ge=0,
                             description="the client's retries (a 429 when the endpoint is busy)")


class Gym(Agent):
    """Episodes of a Gymnasium-style text environment; see the module docstring."""

    Args = GymArgs

    def __init__(self, tokenizer: Any, args: dict[str, Any] | None = None):
        # Agent's own __init__ loads workflow_args.fn: here the agent is `_play`
        Workflow.__init__(self, tokenizer, args)
        self.factory = resolve_gym_env(self.args.env)
        try:
            inspect.signature(self.factory).bind(**self.args.env_args)
        except TypeError as exc:
            raise ValueError(f"workflow_args.env_args for {self.args.env}: {exc}") from None
        except ValueError:
            pass  # no signature to check (a builtin): the first episode says
        self.fn = self._play
        self.model = ""
        self.failures: Counter[str] = Counter()

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        if ctx.endpoint is not None:
            self.model = ctx.endpoint.config.model
        return await super().run(tasks, ctx)

    async def play(self, tasks: list[Task], ctx: RolloutContext) -> list[Outcome]:
        """Every episode of `tasks` in this process, the environment driven by `_play`."""
        try:
            import openai
        except ImportError:
            raise RuntimeError("the gym workflow needs the openai package: "
                               "pip install 'tandem-explorer[agent]'") from None
        gate = asyncio.Semaphore(ctx.endpoint.config.max_concurrency)

        async def episode(task: Task, index: int) -> Outcome:
            out = Outcome(task, index)
            result = await play_episode(out, ctx.endpoint, gate, openai, self.args,
                                        lambda client: self._play(dict(task.payload), client))
            if out.reason == "ok":
                out.reward, out.components, out.reason = score_of(result)
            return out

        return await asyncio.gather(*(episode(task, k) for task in tasks
                                      for k in range(ctx.repeat_times)))

    async def _play(self, payload: dict[str, Any], client: Any) -> dict[str, float]:
        episode = GymEpisode(self.factory(**self.args.env_args), payload, name=self.args.env,
                             reward=self.args.reward)
        try:
            messages = [{"role": "system", "content": self.args.system}] if self.args.system \
                else []
            messages.append({"role": "user", "content": episode.first})
            stop = {"stop": list(self.args.stop)} if self.args.stop else {}
            for _ in range(self.args.max_turns):
                reply = await client.chat.completions.create(model=self.model,
                                                             messages=messages, **stop)
                action = reply.choices[0].message.content or ""
                observation = episode.step(action)
                if observation is None:
                    break
                messages += [{"role": "assistant", "content": action},
                             {"role": "user", "content": observation}]
            return episode.outcome()
        finally:
            episode.close()
