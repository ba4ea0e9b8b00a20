"""A task's chat messages and system prompt through the model's chat template, or the plain
template when the tokenizer has none; and `single_turn` on tasks `master.taskset.format`
made from the user's files, unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.common.config import TasksetConfig
from tandem.common.messages.experience import Task
from tandem.common.messages.reward import Score
from tandem.common.tasks import load_tasks
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.templates import PromptTemplate
from tandem.explorer.workflows import RolloutContext, create_workflow

# (no "\n" after a message: the tiny character tokenizer cannot encode "\n\n")
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}|{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"}]


@pytest.fixture
def tokenizer():
    from tandem.weights.tiny import build_tokenizer

    return build_tokenizer()


def test_messages_through_the_chat_template(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    t = PromptTemplate(tokenizer, system="Be brief.")
    assert tokenizer.decode(t.render_messages(CHAT)) == (
        "[system] Be brief.|[user] 2+2?|[assistant] 4|[user] and 3+3?|[assistant] ")
    own = [{"role": "system", "content": "Mine."}, CHAT[0]]
    assert t.render_messages_text(own) == "[system] Mine.|[user] 2+2?|[assistant] "
    assert tokenizer.decode(t.render_messages(own)) == t.render_messages_text(own)
    # a prompt with its task's own system prompt is the chat of one user message
    assert t.render("2+2?", system="Mine.") == t.render_messages(own)
    assert t.render_text("2+2?") == "[system] Be brief.|[user] 2+2?|[assistant] "


def test_messages_without_a_chat_template_use_the_plain_template(tokenizer):
    assert not tokenizer.chat_template
    t = PromptTemplate(tokenizer, template="{system}Q: {prompt} A:", system="Be brief.")
    one = [{"role": "user", "content": "2+2?"}]
    assert t.render_messages_text(one) == "Be brief.\nQ: 2+2? A:"
    assert t.render_messages(one) == t.render("2+2?")
    own = [{"role": "system", "content": "Mine."}, {"role": "user",
                                                     "content": [{"type": "text", "text": "2+2?"}]}]
    assert t.render_messages_text(own) == "Mine.\nQ: 2+2? A:" == t.render_text("2+2?", "Mine.")
    assert tokenizer.decode(PromptTemplate(tokenizer).render_messages(CHAT)) == (
        "user: 2+2?\nassistant: 4\nuser: and 3+3?\nassistant: ")
    with pytest.raises(ValueError, match="no chat template"):
        PromptTemplate(tokenizer, chat="always")


class RecordingScorer:
    """Scores 1.0 and keeps what it was asked to score."""

    def __init__(self):
        self.items = []

    async def score(self, items):
        self.items += items
        return [Score(score=1.0) for _ in items]

    async def close(self):
        pass


def roll_out(engine, tasks, **args):
    scorer = RecordingScorer()
    wf = create_workflow("single_turn", engine.tokenizer, args)
    ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=2, seed=1),
                         repeat_times=2, explorer="e", scorer=scorer)
    exps = asyncio.run(wf.run([Task(id=t.get("id", str(i)), payload=t)
                               for i, t in enumerate(tasks)], ctx))
    return exps, scorer.items


def test_single_turn_renders_chat_tasks_from_a_csv(engine, tmp_path):
    path = tmp_path / "chats.csv"
    cell = json.dumps(CHAT).replace('"', '""')
    path.write_text(f'uid,conversation,gold,tol\nc1,"{cell}",6,0.5\n')
    cfg = TasksetConfig(path=str(path), format={"messages": "conversation", "answer": "gold",
                                                "args": {"tolerance": "tol"}, "id": "uid",
                                                "system": "Be brief."})
    tasks = load_tasks(cfg.path, format=cfg.format)
    tok = engine.tokenizer
    tok.chat_template = CHAT_TEMPLATE
    try:
        exps, items = roll_out(engine, tasks)
    finally:
        tok.chat_template = None
    assert len(exps) == 2 and {e.task_id for e in exps} == {"c1"}
    assert tok.decode(exps[0].tokens[:exps[0].prompt_len]) == (
        "[system] Be brief.|[user] 2+2?|[assistant] 4|[user] and 3+3?|[assistant] ")
    # the reward gets the question (the last user message), the answer and the arguments
    assert [(i.prompt, i.truth, i.args) for i in items] == [
        ("and 3+3?", "6", {"tolerance": "0.5"})] * 2


def test_single_turn_renders_prompt_tasks_with_their_own_system_prompt(engine, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"q": "1+1=", "s": "Add.", "a": 2}) + "\n"
                    + json.dumps({"q": "2+2=", "s": None, "a": 4}) + "\n")
    cfg = TasksetConfig(path=str(path), format={"prompt": "q", "system_column": "s",
                                                "answer": "a"})
    tasks = load_tasks(cfg.path, format=cfg.format)
    assert tasks == [{"prompt": "1+1=", "system": "Add.", "answer": 2},
                     {"prompt": "2+2=", "answer": 4}]
    exps, items = roll_out(engine, tasks, system="Sum.", template="{system}Q: {prompt}")
    prompts = {e.task_id: engine.tokenizer.decode(e.tokens[:e.prompt_len]) for e in exps}
    # no chat template: the plain one; a task without a system prompt gets the workflow's
    assert prompts == {"0": "Add.\nQ: 1+1=", "1": "Sum.\nQ: 2+2="}
    assert [(i.prompt, i.truth) for i in items] == [("1+1=", 2)] * 2 + [("2+2=", 4)] * 2
