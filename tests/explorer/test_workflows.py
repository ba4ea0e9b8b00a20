"""Workflows with the tiny model: well-formed experiences (masks, lengths, groups, ids)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tandem.common.messages.experience import Task, repeat_id, task_group_id
from tandem.common.messages.reward import Score, ScoreItem
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.templates import PromptTemplate
from tandem.explorer.workflows import RolloutContext, create_workflow


class DigitCountScorer:
    """A reward function of this test: the share of response characters that are digits."""

    def __init__(self):
        self.items: list[ScoreItem] = []

    async def score(self, items):
        self.items += items
        out = []
        for item in items:
            share = sum(ch.isdigit() for ch in item.response) / max(1, len(item.response))
            out.append(Score(score=share, components={"digits": share, "format": 1.0}))
        return out

    async def close(self):
        pass


def check_experience(exp, *, group_size):
    n = len(exp.tokens)
    assert exp.tokens.dtype == np.int32 and exp.action_mask.dtype == np.uint8
    assert exp.logprobs.dtype == np.float32
    assert len(exp.action_mask) == len(exp.logprobs) == n - exp.prompt_len > 0
    assert np.all(exp.logprobs[exp.action_mask == 0] == 0.0)
    assert np.all(exp.logprobs[exp.action_mask == 1] <= 0.0)
    assert exp.info["group_size"] == group_size
    # named by the task's place in the run, never by the weights or the explorer
    assert exp.group_id.startswith(f"{exp.task_id}@e{exp.info['epoch']}.")
    # the message validates its own lengths; a round trip through pydantic must hold
    type(exp).model_validate(exp.model_dump())


def test_single_turn_groups_samples_and_rewards(engine):
    engine.version = 2
    scorer = DigitCountScorer()
    wf = create_workflow("single_turn", engine.tokenizer, {"prompt_key": "question"})
    tasks = [Task(id=f"t{i}", payload={"question": f"{i}+{i}=", "answer": str(2 * i)})
             for i in range(3)]
    ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=12, seed=0),
                         repeat_times=4, explorer="explorer-0", run="run1",
                         scorer=scorer, step=5)
    exps = asyncio.run(wf.run(tasks, ctx))
    assert len(exps) == 12 and len({e.id for e in exps}) == 12
    for i, task in enumerate(tasks):
        group = exps[4 * i:4 * i + 4]
        assert {e.group_id for e in group} == {task_group_id("run1", 0, f"t{i}")}
        assert [e.id for e in group] == [repeat_id(task_group_id("run1", 0, task.id), k)
                                         for k in range(4)]
        prompt = engine.tokenizer(f"{i}+{i}=").input_ids
        for e in group:
            check_experience(e, group_size=4)
            assert list(e.tokens[:e.prompt_len]) == prompt
            assert e.action_mask.all() and e.policy_version == 2 and e.info["step"] == 5
            assert e.rewards == {"digits": e.reward, "format": 1.0}
            assert e.info["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert [it.truth for it in scorer.items] == ["0"] * 4 + ["2"] * 4 + ["4"] * 4
    assert scorer.items[0].response == engine.tokenizer.decode(
        exps[0].tokens[exps[0].prompt_len:], skip_special_tokens=True)


def test_single_turn_names_a_missing_prompt_field(engine):
    wf = create_workflow("single_turn", engine.tokenizer, {})
    ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=2), repeat_times=1,
                         explorer="e", scorer=DigitCountScorer())
    with pytest.raises(ValueError, match="has no 'prompt' field"):
        asyncio.run(wf.run([Task(id="x", payload={"question": "?"})], ctx))


def test_unknown_workflow_and_bad_args_are_clear_errors(engine):
    with pytest.raises(ValueError, match="unknown workflow 'nope'"):
        create_workflow("nope", engine.tokenizer)
    with pytest.raises(ValueError, match="promptkey"):
        create_workflow("single_turn", engine.tokenizer, {"promptkey": "q"})
    with pytest.raises(ValueError, match="unknown environment"):
        create_workflow("multi_turn", engine.tokenizer, {"env": "chess"})


def test_a_task_rolled_out_again_elsewhere_with_newer_weights_fills_the_same_group(engine):
    # An explorer that died after its put (or was declared dead) has its tasks leased again,
    # by its restart or another explorer, under newer weights: the buffer must see the same
    # experience ids and store nothing new, so no task is trained twice.
    wf = create_workflow("single_turn", engine.tokenizer, {"prompt_key": "question"})
    tasks = [Task(id="t0", payload={"question": "1+1=", "answer": "2"}, epoch=1)]
    runs = []
    for version, explorer in ((3, "explorer-0"), (5, "explorer-1")):
        engine.version = version
        ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=4, seed=version),
                             repeat_times=2, explorer=explorer, run="run1",
                             scorer=DigitCountScorer(), step=version)
        runs.append(asyncio.run(wf.run(tasks, ctx)))
    first, again = runs
    assert [e.id for e in first] == [e.id for e in again]
    assert {e.group_id for e in first} == {e.group_id for e in again}
    assert [e.policy_version for e in again] == [5, 5]
    # the same task in another epoch, or another run, is another group
    other_epoch = Task(id="t0", payload=tasks[0].payload, epoch=2)
    ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=4), repeat_times=2,
                         explorer="explorer-0", run="run1", scorer=DigitCountScorer())
    assert {e.group_id for e in asyncio.run(wf.run([other_epoch], ctx))}.isdisjoint(
        {e.group_id for e in first})
    assert task_group_id("run2", 1, "t0") != first[0].group_id


def test_multi_turn_masks_environment_tokens_and_keeps_the_budget(engine):
    # The random tiny model never writes a valid guess, so every turn draws the environment's
    # "invalid" feedback: episodes alternate model tokens (mask 1) and feedback (mask 0).
    wf = create_workflow("multi_turn", engine.tokenizer, {
        "env": "guess_number", "max_turns": 3, "max_episode_tokens": 200,
        "env_args": {"max_guesses": 10}})
    tasks = [Task(id="g0", payload={"secret": 7, "low": 1, "high": 10}),
             Task(id="g1", payload={"seed": 3})]
    ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=10, seed=1),
                         repeat_times=2, explorer="explorer-0", run="run1")
    exps = asyncio.run(wf.run(tasks, ctx))
    assert len(exps) == 4 and [e.group_id for e in exps] == [task_group_id("run1", 0, t) for t in ("g0", "g0", "g1", "g1")]
    feedback = engine.tokenizer("<feedback>invalid: write <guess>N</guess></feedback>\n",
                                add_special_tokens=False).input_ids
    for e in exps:
        check_experience(e, group_size=2)
        assert e.info["turns"] == 3 and e.info["end"] == "max_turns"
        mask = e.action_mask.tolist()
        response = e.tokens[e.prompt_len:].tolist()
        # three model turns of 10 tokens, two feedback replies between them
        assert mask == [1] * 10 + [0] * len(feedback) + [1] * 10 + [0] * len(feedback) + [1] * 10
        assert response[10:10 + len(feedback)] == feedback
        assert e.rewards["solved"] == 0.0 and e.rewards["guesses"] == 3.0
        assert e.reward == 0.0

    tight = create_workflow("multi_turn", engine.tokenizer, {
        "env": "guess_number", "max_turns": 5, "max_episode_tokens": 25})
    for e in asyncio.run(tight.run(tasks[:1], ctx)):
        assert len(e.tokens) - e.prompt_len <= 25 and e.info["end"] == "budget"
        assert e.action_mask[-1] == 1  # an episode ends on a model turn, never a cut reply


def test_multi_turn_calculator_prompt_uses_the_template(engine):
    wf = create_workflow("multi_turn", engine.tokenizer, {
        "env": "calculator", "template": "Q: {prompt}\nA: ", "chat": "never"})
    ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=8, seed=2),
                         repeat_times=3, explorer="e")
    [e0, *_] = exps = asyncio.run(wf.run([Task(id="c", payload={"expression": "6*7"})], ctx))
    prompt = engine.tokenizer.decode(e0.tokens[:e0.prompt_len])
    assert prompt.startswith("Q: What is 6*7?\n") and prompt.endswith("\nA: ")
    for e in exps:
        check_experience(e, group_size=3)
        # no tool call and no answer: the calculator ends the episode after the first turn
        assert e.info["end"] in ("env", "eos") and e.info["turns"] == 1
        assert e.rewards["correctness"] == 0.0


def test_chat_template_is_used_when_the_tokenizer_has_one(engine):
    tok = engine.tokenizer
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    try:
        t = PromptTemplate(tok, system="be brief")
        assert tok.decode(t.render("hi")) == "[system] be brief\n[user] hi\n[assistant] "
        # an environment's reply closes the model's turn and opens the next one
        assert tok.decode(t.render_reply("5", "tool")) == "\n[tool] 5\n[assistant] "
        plain = PromptTemplate(tok, chat="never", template="{system}Q: {prompt}", system="sys")
        assert tok.decode(plain.render("hi")) == "sys\nQ: hi"
        assert tok.decode(plain.render_reply("<r>5</r>\n")) == "<r>5</r>\n"
    finally:
        tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        PromptTemplate(tok, chat="always")


@pytest.mark.parametrize("where", ["in_process", "service"])
async def test_single_turn_scores_through_tandem_reward(engine, where, tmp_path):
    # The same rollout scored by the real math reward, in this process or by the reward
    # service over RPC; the tiny model's answers are wrong, the named components are there.
    from tandem.common.config import load_config
    from tandem.explorer.rewards import create_scorer
    from tandem.reward import RewardService

    config = load_config(None, ["master.total_steps=1", "reward.functions.math=1.0",
                                "reward.workers=1", "reward.address=tcp://127.0.0.1:0",
                                f"reward.service={where == 'service'}"])
    service = None
    if where == "service":
        service = RewardService(config)
        config.reward.address = await service.start()
    scorer = create_scorer(config.reward, config.transport)
    try:
        wf = create_workflow("single_turn", engine.tokenizer, {})
        ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=6, seed=4),
                             repeat_times=2, explorer="e", scorer=scorer)
        exps = await wf.run([Task(id="m", payload={"prompt": "2+2=", "answer": "4"})], ctx)
    finally:
        await scorer.close()
        if service is not None:
            await service.close()
    assert len(exps) == 2
    for e in exps:
        check_experience(e, group_size=2)
        assert "math" in e.rewards and e.reward == pytest.approx(e.rewards["math"])
        assert e.info["reward_reason"]


def test_multi_turn_with_a_chat_template_renders_replies_as_messages(engine):
    tok = engine.tokenizer
    # (no "\n" after a message: the tiny character tokenizer cannot encode "\n\n")
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}|{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    try:
        wf = create_workflow("multi_turn", tok, {"env": "guess_number", "max_turns": 2})
        ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=5, seed=3),
                             repeat_times=1, explorer="e")
        [e] = asyncio.run(wf.run([Task(id="g", payload={"secret": 3})], ctx))
    finally:
        tok.chat_template = None
    prompt = tok.decode(e.tokens[:e.prompt_len])
    assert prompt.startswith("[user] I am thinking") and prompt.endswith("|[assistant] ")
    mask = e.action_mask.tolist()
    reply = tok.decode(e.tokens[e.prompt_len:][5:mask.index(1, 5)])
    assert mask[:5] == [1] * 5 and mask[-5:] == [1] * 5
    assert reply == "|[user] <feedback>invalid: write <guess>N</guess></feedback>\n|[assistant] "
