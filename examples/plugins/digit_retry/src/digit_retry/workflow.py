"""The `scored_multi_turn` workflow: tandem's `multi_turn` episodes, each scored by a reward
function on the model's attempts instead of by the environment's own verdict.

An attempt is one model turn: the tokens the policy sampled between two environment replies
(action mask 1). Every episode of the batch goes to `ctx.scorer` in one call, as a `ScoreItem`
with the task's answer as `truth` and the attempts in `args.attempts`; the scorer runs the
function where the run's `reward` section says (isolated ones in worker processes, or the
reward service). The environment's own outcome stays in the experience as `env.*` components.
"""

from __future__ import annotations

from pydantic import Field

from tandem.common.messages.experience import Experience, Task
from tandem.common.messages.reward import ScoreItem
from tandem.explorer.workflows import RolloutContext
from tandem.explorer.workflows.multi_turn import MultiTurn, MultiTurnArgs


class ScoredMultiTurnArgs(MultiTurnArgs):
    reward_fn: str | None = Field(
        default=None, description="reward function for every episode; default: reward.functions")
    answer_key: str = Field(default="answer", description="task field holding the gold answer")


class ScoredMultiTurn(MultiTurn):
    Args = ScoredMultiTurnArgs

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        if ctx.scorer is None:
            raise RuntimeError("scored_multi_turn needs a reward scorer (the reward section)")
        episodes = await super().run(tasks, ctx)
        attempts = [self.attempts(e) for e in episodes]
        items = [ScoreItem(fn=self.args.reward_fn, prompt=self.question(t),
                           response=a[-1] if a else "", truth=t.payload.get(self.args.answer_key),
                           args={**t.payload.get("reward_args", {}), "attempts": a})
                 for t, a in zip(self.task_per_episode(tasks, ctx), attempts)]
        scores = await ctx.scorer.score(items)
        return [e.model_copy(update={
                    "reward": s.score,
                    "rewards": {**s.components, **{f"env.{k}": v for k, v in e.rewards.items()}},
                    "info": {**e.info, "attempts": a, "reward_reason": s.reason}})
                for e, a, s in zip(episodes, attempts, scores)]

    def question(self, task: Task) -> str:
        return self.env_cls(task.payload, **self.args.env_args).instructions()

    @staticmethod
    def task_per_episode(tasks: list[Task], ctx: RolloutContext) -> list[Task]:
        """`multi_turn` returns each task's `repeat_times` episodes together, in task order."""
        return [t for t in tasks for _ in range(ctx.repeat_times)]

    def attempts(self, episode: Experience) -> list[str]:
        """The text of each model turn: each run of action tokens in the response."""
        turns: list[list[int]] = []
        previous = 0
        for token, action in zip(episode.tokens[episode.prompt_len:].tolist(),
                                 episode.action_mask.tolist()):
            if action and not previous:
                turns.append([])
            if action:
                turns[-1].append(token)
            previous = action
        return [self.tokenizer.decode(t, skip_special_tokens=True).strip() for t in turns]
