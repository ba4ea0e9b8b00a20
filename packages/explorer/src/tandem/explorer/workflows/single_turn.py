"""`single_turn`: a prompt template, `repeat_times` samples per task, rewards for each."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from tandem.common.messages.experience import Experience, Task
from tandem.common.messages.reward import ScoreItem

from ..templates import PromptTemplate
from .base import RolloutContext, Trajectory, Workflow, WorkflowArgs, make_experience


class SingleTurnArgs(WorkflowArgs):
    prompt_key: str = Field(default="prompt", description="payload field holding the question")
    answer_key: str = Field(default="answer", description="payload field holding the gold answer")
    system: str | None = Field(default=None, description="system prompt")
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
        try:
            value = task.payload[self.args.prompt_key]
        except KeyError:
            raise ValueError(
                f"task {task.id!r} has no {self.args.prompt_key!r} field "
                f"(has {sorted(task.payload)}); set workflow_args.prompt_key") from None
        return str(value)

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        if ctx.scorer is None:
            raise RuntimeError("single_turn needs a reward scorer (reward section)")
        prompts = [self.template.render(self.prompt_of(t)) for t in tasks]
        t0 = time.time()
        completions = await ctx.engine.generate(prompts, ctx.repeat_times, ctx.sampling)
        t1 = time.time()
        texts = [self.prompt_of(t) for t in tasks]
        items = [ScoreItem(fn=self.args.reward_fn, prompt=texts[i], response=c.text,
                           truth=task.payload.get(self.args.answer_key),
                           args=task.payload.get("reward_args", {}))
                 for i, task in enumerate(tasks) for c in completions[i]]
        scores = await ctx.scorer.score(items)
        t2 = time.time()
        experiences = []
        for i, task in enumerate(tasks):
            for k, c in enumerate(completions[i]):
                score = scores[i * ctx.repeat_times + k]
                traj = Trajectory(prompts[i])
                traj.add(c.token_ids, c.logprobs, action=True)
                experiences.append(make_experience(
                    task, k, traj, ctx, reward=score.score,
                    rewards=score.components or {"reward": score.score},
                    info={"finish_reason": c.finish_reason, "reward_reason": score.reason,
                          "generate_s": t1 - t0, "reward_s": t2 - t1,
                          "engine": c.timings}))
        return experiences
