"""`multi_turn`: episodes with an environment, every turn of every episode batched together.

An episode starts from the environment's instructions rendered as the prompt. Each round, every
unfinished episode gets one model turn (ending at the environment's stop strings, eos, or the
per-turn token limit); the environment's reply is appended with action_mask 0 and logprob 0
(as a chat message of `reply_role` when the tokenizer has a chat template, as plain text
otherwise). An episode ends when the environment says so, the model emits eos, it has taken `max_turns`
turns, or its response (model and environment tokens) would pass `max_episode_tokens`.

A task that shows images (`payload["images"]`, docs/vision.md) puts them before the
instructions in the first user message, like `single_turn`; every turn's prompt is an
`ImagePrompt` of those images (the engine widens the placeholders again each turn), and the
experience records the widened prompt and the images' hashes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from tandem.common.images import image_hash
from tandem.common.messages.experience import Experience, Task

from ..engine import ImagePrompt, Prompt
from ..environments import Environment, get_environment
from ..templates import PromptTemplate
from .base import RolloutContext, Trajectory, Workflow, WorkflowArgs, make_experience


class MultiTurnArgs(WorkflowArgs):
    env: str = Field(description="environment registry name: calculator, guess_number")
    env_args: dict[str, Any] = Field(default_factory=dict,
                                     description="keyword arguments of the environment")
    max_turns: int = Field(default=8, ge=1, description="model turns per episode")
    max_episode_tokens: int = Field(
        default=512, ge=1, description="token budget of the whole response (model + environment)")
    system: str | None = None
    chat: Literal["auto", "always", "never"] = "auto"
    template: str = "{system}{prompt}"
    reply_role: str = Field(default="user", description="chat role of the environment's replies")


@dataclass
class _Episode:
    task: Task
    index: int
    env: Environment
    traj: Trajectory
    turns: int = 0
    done: bool = False
    end: str = ""
    generate_s: float = 0.0
    finish_reasons: list[str] = field(default_factory=list)
    shown: ImagePrompt | None = None  # the first turn's prompt, when the task shows images

    def prompt(self) -> Prompt:
        """This turn's prompt: the episode so far, with the task's images if it shows any."""
        if self.shown is None:
            return self.traj.tokens
        if self.turns == 0:
            return self.shown
        # the placeholders unwidened (the engine widens them), then the turns so far; a server
        # that renders the chat itself gets none (RemoteEngine refuses: docs/vision.md)
        return dataclasses.replace(self.shown, ids=[*self.shown.ids, *self.traj.response_ids],
                                   messages=None)


class MultiTurn(Workflow):
    """Episodes against an environment from the registry (`workflow_args.env`)."""

    Args = MultiTurnArgs

    def __init__(self, tokenizer: Any, args: dict[str, Any] | None = None):
        super().__init__(tokenizer, args)
        self.env_cls = get_environment(self.args.env)
        self.template = PromptTemplate(tokenizer, chat=self.args.chat,
                                       template=self.args.template, system=self.args.system)

    def _new_episode(self, task: Task, index: int) -> _Episode:
        try:
            env = self.env_cls(task.payload, **self.args.env_args)
        except TypeError as exc:
            raise ValueError(f"workflow_args.env_args for {self.args.env}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"task {task.id!r}: {exc}") from None
        images = task.payload.get("images")
        if not images:
            return _Episode(task, index, env,
                            Trajectory(self.template.render(env.instructions())))
        messages = [{"role": "user", "content": [
            *({"type": "image"} for _ in images), {"type": "text", "text": env.instructions()}]}]
        shown = ImagePrompt(self.template.render_messages(messages), list(images),
                            [image_hash(i) for i in images], messages)
        return _Episode(task, index, env, Trajectory(list(shown.ids), images=list(shown.hashes)),
                        shown=shown)

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        episodes = [self._new_episode(t, k) for t in tasks for k in range(ctx.repeat_times)]
        budget = self.args.max_episode_tokens
        stops = tuple(dict.fromkeys(ctx.sampling.stop + self.env_cls.stop))
        sampling = dataclasses.replace(ctx.sampling, stop=stops)
        start = time.time()
        while active := [ep for ep in episodes if not ep.done]:
            t0 = time.time()
            turns = await ctx.engine.generate([ep.prompt() for ep in active], 1, sampling)
            elapsed = time.time() - t0
            for ep, [c] in zip(active, turns):
                if ep.shown is not None and ep.turns == 0:
                    ep.traj.prompt_ids = c.prompt_ids.tolist()  # widened: what the trainer sees
                ep.generate_s += elapsed
                ep.turns += 1
                ep.finish_reasons.append(c.finish_reason)
                room = budget - len(ep.traj.response_ids)
                ep.traj.add(c.token_ids[:room], c.logprobs[:room], action=True,
                            versions=c.token_versions)
                if len(c.token_ids) >= room:
                    self._finish(ep, "budget")
                elif c.finish_reason == "eos":
                    self._finish(ep, "eos")
                else:
                    reply = ep.env.step(c.text)
                    if reply.done:
                        self._finish(ep, "env")
                    elif ep.turns >= self.args.max_turns:
                        self._finish(ep, "max_turns")
                    else:
                        ids = self.template.render_reply(reply.text, self.args.reply_role)
                        if len(ids) >= budget - len(ep.traj.response_ids):
                            self._finish(ep, "budget")  # end on a model turn, not a cut reply
                        else:
                            ep.traj.add(ids, action=False)
        wall = time.time() - start
        experiences = []
        for ep in episodes:
            outcome = ep.env.outcome()
            experiences.append(make_experience(
                ep.task, ep.index, ep.traj, ctx, reward=outcome.reward, rewards=outcome.components,
                info={"env": self.args.env, "turns": ep.turns, "end": ep.end,
                      "finish_reasons": ep.finish_reasons, "reward_reason": outcome.reason,
                      "generate_s": ep.generate_s, "episode_s": wall}))
        return experiences

    @staticmethod
    def _finish(ep: _Episode, why: str) -> None:
        ep.done = True
        ep.end = why
