"""`single_turn`: a prompt template, `repeat_times` samples per task, rewards for each.

A task is a prompt (`prompt_key`, with the task's own system prompt under `system_key`) or a
chat (`messages_key`: a list of {role, content}), as `master.taskset.format` makes them; the
prompt goes through the model's chat template, or the plain template without one. A task with
`images` (normalised PNG bytes, docs/vision.md) becomes an `ImagePrompt`: its chat with an image
part per image (a prompt's images go before its text in one user message), so the template
writes one placeholder per image, which the engine widens."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from pydantic import Field

from tandem.common.images import image_hash
from tandem.common.messages.experience import Experience, Task
from tandem.common.messages.reward import ScoreItem

from ..engine import Completion, ImagePrompt, Prompt
from ..templates import PromptTemplate, message_text
from .base import (
    RolloutContext, Trajectory, Workflow, WorkflowArgs, make_experience, settle_group_versions)


class SingleTurnArgs(WorkflowArgs):
    prompt_key: str = Field(default="prompt", description="payload field holding the question")
    messages_key: str = Field(default="messages",
                              description="payload field holding chat messages, read when the "
                                          "task has no prompt_key field")
    system_key: str = Field(default="system",
                            description="payload field holding the task's own system prompt")
    answer_key: str = Field(default="answer", description="payload field holding the gold answer")
    system: str | None = Field(default=None,
                               description="system prompt of tasks that carry none")
    chat: Literal["auto", "always", "never"] = "auto"
    template: str = Field(default="{system}{prompt}", description="plain template, no chat one")
    reward_fn: str | None = Field(
        default=None, description="reward function for every item; default: reward.functions")


class SingleTurn(Workflow):
    """Prompt → n samples → reward per sample; the n samples of a task form its group."""

    Args = SingleTurnArgs

    def __init__(self, tokenizer: Any, args: dict[str, Any] | None = None):
        super().__init__(tokenizer, args)
        self.template = PromptTemplate(tokenizer, chat=self.args.chat,
                                       template=self.args.template, system=self.args.system)

    def prompt_of(self, task: Task) -> str:
        """The question's text, for the reward: the prompt, or a chat's last user message."""
        payload, a = task.payload, self.args
        if a.prompt_key in payload:
            return str(payload[a.prompt_key])
        messages = payload.get(a.messages_key)
        if isinstance(messages, list) and messages:
            users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            return message_text((users or messages)[-1])
        raise ValueError(
            f"task {task.id!r} has no {a.prompt_key!r} field nor a {a.messages_key!r} list "
            f"(has {sorted(payload)}); set workflow_args.prompt_key or master.taskset.format")

    def render(self, task: Task) -> Prompt:
        """The task's prompt token ids, or an `ImagePrompt` for a task that shows images."""
        payload, a = task.payload, self.args
        images = payload.get("images")
        if images:
            if a.prompt_key not in payload and isinstance(payload.get(a.messages_key), list):
                messages = payload[a.messages_key]
            else:
                system = payload.get(a.system_key)
                messages = ([{"role": "system", "content": system}]
                            if isinstance(system, str) and system else [])
                messages.append({"role": "user", "content": [
                    *({"type": "image"} for _ in images),
                    {"type": "text", "text": self.prompt_of(task)}]})
            return ImagePrompt(self.template.render_messages(messages), list(images),
                               [image_hash(i) for i in images], messages)
        if a.prompt_key not in payload and isinstance(payload.get(a.messages_key), list):
            return self.template.render_messages(payload[a.messages_key])
        system = payload.get(a.system_key)
        return self.template.render(self.prompt_of(task),
                                    system=system if isinstance(system, str) else None)

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        if ctx.scorer is None:
            raise RuntimeError("single_turn needs a reward scorer (reward section)")
        prompts = [self.render(t) for t in tasks]
        if ctx.on_group is not None:
            return await self._stream(tasks, prompts, ctx)
        t0 = time.time()
        completions = await ctx.engine.generate(prompts, ctx.repeat_times, ctx.sampling)
        t1 = time.time()
        items = [item for i, task in enumerate(tasks)
                 for item in self._items(task, completions[i])]
        scores = await ctx.scorer.score(items)
        t2 = time.time()
        n = ctx.repeat_times
        return [e for i, task in enumerate(tasks)
                for e in self._group(task, prompts[i], completions[i], scores[i * n:(i + 1) * n],
                                     ctx, generate_s=t1 - t0, reward_s=t2 - t1)]

    async def _stream(self, tasks: list[Task], prompts: list[Prompt],
                      ctx: RolloutContext) -> list[Experience]:
        """Each task's group is scored and handed to `ctx.on_group` as soon as its responses
        are sampled, while the engine goes on with the others."""
        t0 = time.time()
        pending: dict[int, asyncio.Task] = {}

        async def finish(i: int, completions: list[Completion]) -> list[Experience]:
            t1 = time.time()
            scores = await ctx.scorer.score(self._items(tasks[i], completions))
            group = self._group(tasks[i], prompts[i], completions, scores, ctx,
                                generate_s=t1 - t0, reward_s=time.time() - t1)
            await ctx.on_group(group)
            return group

        def ready(i: int, completions: list[Completion]) -> None:
            pending[i] = asyncio.ensure_future(finish(i, completions))

        try:
            await ctx.engine.generate_each(prompts, ctx.repeat_times, ctx.sampling, ready)
            groups = await asyncio.gather(*(pending[i] for i in range(len(tasks))))
        finally:
            for task in pending.values():
                task.cancel()
        return [e for group in groups for e in group]

    def _items(self, task: Task, completions: list[Completion]) -> list[ScoreItem]:
        return [ScoreItem(fn=self.args.reward_fn, prompt=self.prompt_of(task), response=c.text,
                          truth=task.payload.get(self.args.answer_key),
                          args=task.payload.get("reward_args", {}))
                for c in completions]

    def _group(self, task: Task, prompt: Prompt, completions: list[Completion], scores: list,
               ctx: RolloutContext, *, generate_s: float, reward_s: float) -> list[Experience]:
        experiences = []
        shown = list(prompt.hashes) if isinstance(prompt, ImagePrompt) else []
        for k, (c, score) in enumerate(zip(completions, scores)):
            # an image prompt's ids as the engine widened them: the placeholders the trainer
            # fills with the same images
            traj = Trajectory(c.prompt_ids.tolist() if shown else prompt, images=shown)
            traj.add(c.token_ids, c.logprobs, action=True, versions=c.token_versions)
            experiences.append(make_experience(
                task, k, traj, ctx, reward=score.score,
                rewards=score.components or {"reward": score.score},
                info={"finish_reason": c.finish_reason, "reward_reason": score.reason,
                      "generate_s": generate_s, "reward_s": reward_s, "engine": c.timings}))
        return settle_group_versions(experiences)
