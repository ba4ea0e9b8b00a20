"""Environments from elsewhere, run unchanged: verifiers environments and a Gymnasium text game,
written here as their users write them, rolled out end to end by the `verifiers` and `gym`
workflows through the explorer's OpenAI endpoint with a real tiny model (the calculator-agent
model of tests/agent_model.py, which has a chat template).

This module is also a verifiers environment package: its `load_environment` is what
`vf.load_environment("echo-env")` finds once the module answers to the name `echo_env`.
"""

from __future__ import annotations

import signal
import sys
from typing import ClassVar

import gymnasium as gym
import numpy as np
import pytest

# verifiers is the optional extra tandem-explorer[verifiers]: `make test` installs it, the vLLM
# tier's venv cannot (its datasets pin clashes with vLLM's fsspec)
vf = pytest.importorskip("verifiers")
from datasets import Dataset

from tandem.common.config.explorer import OpenAIConfig
from tandem.common.errors import ConfigError
from tandem.common.messages.experience import Task
from tandem.common.plugins import ENVIRONMENTS, TASKSET_READERS, WORKFLOWS, load_installed
from tandem.common.tasks import load_rows
from tandem.explorer.openai_server import OpenAIEndpoint
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.verifiers_loader import load_environment as load_vf_environment
from tandem.explorer.verifiers_loader import parse_source, read_taskset
from tandem.explorer.workflows import RolloutContext
from tandem.explorer.workflows.gym_text import Gym
from tandem.explorer.workflows.verifiers_env import Verifiers

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
HERE = __name__


# -- a user's verifiers environments ------------------------------------------------------------

def _text(completion) -> str:
    return completion[-1]["content"]


def says_answer(completion, answer) -> float:
    return float(answer in _text(completion))


def brevity(completion) -> float:
    return 1.0 / (1.0 + len(_text(completion)))


def group_size(states) -> list[float]:
    """A group reward function: it sees the whole group at once."""
    return [float(len(states))] * len(states)


def load_environment(brevity_weight: float = 0.5) -> vf.Environment:
    """A single-turn environment: two questions, and a rubric of three functions."""
    dataset = Dataset.from_list([{"question": "What is 12*7?", "answer": "84"},
                                 {"question": "Say 8", "answer": "8"}])
    rubric = vf.Rubric(funcs=[says_answer, brevity, group_size],
                       weights=[1.0, brevity_weight, 0.0])
    return vf.SingleTurnEnv(dataset=dataset, system_prompt="Answer briefly.", rubric=rubric)


class Nagging(vf.MultiTurnEnv):
    """Asks again after every answer until its turns run out."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=f"Again ({len(state['trajectory'])})")]


def load_nagging(max_turns: int = 3) -> vf.Environment:
    dataset = Dataset.from_list([{"question": "What is 12*7?", "answer": "84"}])
    return Nagging(dataset=dataset, rubric=vf.Rubric(funcs=[says_answer]), max_turns=max_turns)


class Flaky(Nagging):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the judge is down")


def load_flaky() -> vf.Environment:
    dataset = Dataset.from_list([{"question": "What is 12*7?", "answer": "84"}])
    return Flaky(dataset=dataset, rubric=vf.Rubric(funcs=[says_answer]), max_turns=3)


# -- a user's Gymnasium text game ---------------------------------------------------------------

class LetterGame(gym.Env):
    """Each round the player says a word; a word with the task's letter scores 1, else -0.25.
    The game ends after `rounds` rounds. Every instance is kept in GAMES for the tests."""

    metadata: ClassVar[dict] = {"render_modes": []}
    observation_space = gym.spaces.Text(max_length=200)
    action_space = gym.spaces.Text(max_length=200)

    def __init__(self, rounds: int = 2):
        self.rounds = rounds
        self.actions: list[str] = []
        self.rewards: list[float] = []
        self.observations: list[str] = []
        self.closed = False
        GAMES.append(self)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.letter = options["letter"]
        self.observations = [f"Round 1: say a word with the letter {self.letter}."]
        return self.observations[0], {}

    def step(self, action):
        self.actions.append(action)
        self.rewards.append(1.0 if self.letter in action else -0.25)
        over = len(self.actions) >= self.rounds
        self.observations.append(f"Round {len(self.actions) + 1}: again, {self.letter}.")
        return self.observations[-1], self.rewards[-1], over, False, {}

    def close(self):
        self.closed = True


class BrokenGame(LetterGame):
    def step(self, action):
        raise RuntimeError("the board fell over")


class NumberGame(LetterGame):
    def step(self, action):
        return 7, 0.0, False, False, {}


GAMES: list[LetterGame] = []


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def agent_engine(agent_model_dir):
    from tandem.explorer.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(agent_model_dir, max_batch=16)
    yield engine
    engine.close()


@pytest.fixture
def as_env_package(monkeypatch):
    """This module, importable as the installed environment package `echo_env`."""
    monkeypatch.setitem(sys.modules, "echo_env", sys.modules[HERE])


def context(engine, endpoint, repeat_times=2) -> RolloutContext:
    return RolloutContext(engine=engine, sampling=GREEDY, repeat_times=repeat_times,
                          explorer="explorer-0", run="test", endpoint=endpoint)


async def rollout(workflow, engine, tasks, repeat_times=2):
    endpoint = OpenAIEndpoint(OpenAIConfig(), engine, sampling=GREEDY, context=512)
    await endpoint.start()
    try:
        return await workflow.run(tasks, context(engine, endpoint, repeat_times))
    finally:
        await endpoint.close()


def encode(engine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)


def turns(exp) -> list[tuple[int, list[int]]]:
    """The response as runs of (mask, token ids)."""
    runs: list[tuple[int, list[int]]] = []
    for mask, tok in zip(exp.action_mask.tolist(), exp.tokens[exp.prompt_len:].tolist()):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(tok)
        else:
            runs.append((mask, [tok]))
    return runs


def model_text(engine, ids: list[int]) -> str:
    """What the endpoint answered for a turn: its tokens without the closing eos."""
    if ids and ids[-1] == engine.tokenizer.eos_token_id:
        ids = ids[:-1]
    return engine.tokenizer.decode(ids)


# -- verifiers ----------------------------------------------------------------------------------

async def test_verifiers_single_turn_env_by_id_scored_by_its_rubric(agent_engine, as_env_package):
    # the master reads the taskset through the reader `verifiers`, as a run config names it
    load_installed()
    rows = load_rows("echo-env?brevity_weight=0.5", reader="verifiers")
    assert [r["answer"] for r in rows] == ["84", "8"] and all("prompt" in r for r in rows)
    workflow = Verifiers(agent_engine.tokenizer, {"env": "echo-env",
                                                  "env_args": {"brevity_weight": 0.5}})
    tasks = [Task(id=str(r["example_id"]), payload=r) for r in rows]
    experiences = await rollout(workflow, agent_engine, tasks)

    assert len(experiences) == 4 and len({e.group_id for e in experiences}) == 2
    tok = agent_engine.tokenizer
    for exp, row in zip(experiences, [rows[0], rows[0], rows[1], rows[1]]):
        assert exp.info["rule"] == "chained" and exp.info["calls"] == 1
        assert exp.info["reward_reason"] == "ok"
        prompt = tok.apply_chat_template(row["prompt"], tokenize=False,
                                         add_generation_prompt=True)
        assert exp.tokens[:exp.prompt_len].tolist() == encode(agent_engine, prompt)
        assert row["prompt"][0] == {"role": "system", "content": "Answer briefly."}
        # the model's whole answer, every token an action, as the engine itself samples it
        [[direct]] = agent_engine.generate_sync([exp.tokens[:exp.prompt_len].tolist()], 1,
                                                GREEDY)
        assert exp.tokens[exp.prompt_len:].tolist() == direct.token_ids.tolist()
        assert exp.action_mask.tolist() == [1] * len(direct)
        np.testing.assert_allclose(exp.logprobs, direct.logprobs, atol=1e-5)  # batched
        # the reward is the rubric's, on the text the environment received
        completion = [{"role": "assistant",
                       "content": model_text(agent_engine, direct.token_ids.tolist())}]
        parts = {"says_answer": says_answer(completion, row["answer"]),
                 "brevity": brevity(completion), "group_size": 2.0}
        assert exp.rewards == pytest.approx({**parts, "num_turns": 1.0,
                                             "reward": parts["says_answer"]
                                             + 0.5 * parts["brevity"]})
        assert exp.reward == pytest.approx(exp.rewards["reward"]) and exp.reward > 0


async def test_verifiers_multi_turn_env_masks_its_responses(agent_engine):
    workflow = Verifiers(agent_engine.tokenizer, {"env": f"{HERE}:load_nagging",
                                                  "env_args": {"max_turns": 3}})
    [row] = read_taskset(f"{HERE}:load_nagging?max_turns=3")
    experiences = await rollout(workflow, agent_engine, [Task(id="t", payload=row)])
    assert len(experiences) == 2
    for exp in experiences:
        assert exp.info["rule"] == "chained" and exp.info["calls"] == 3
        assert exp.info["turns"] == 3 and exp.info["stop_condition"] == "max_turns_reached"
        runs = turns(exp)
        assert [m for m, _ in runs] == [1, 0, 1, 0, 1]  # model, environment, model, ...
        env_said = [agent_engine.tokenizer.decode(ids) for m, ids in runs if m == 0]
        assert "Again (1)" in env_said[0] and "Again (2)" in env_said[1]
        assert not exp.logprobs[exp.action_mask == 0].any()
        last = model_text(agent_engine, runs[-1][1])
        expected = says_answer([{"role": "assistant", "content": last}], "84")
        assert exp.reward == expected and exp.rewards["says_answer"] == expected
        assert exp.rewards["num_turns"] == 3.0


async def test_verifiers_environment_that_raises_scores_zero(agent_engine):
    workflow = Verifiers(agent_engine.tokenizer, {"env": f"{HERE}:load_flaky"})
    [row] = read_taskset(f"{HERE}:load_flaky")
    [exp] = await rollout(workflow, agent_engine, [Task(id="t", payload=row)], repeat_times=1)
    # the call the model made is still an experience, scored 0, with the reason
    assert exp.info["calls"] == 1 and exp.reward == 0 and exp.rewards["reward"] == 0
    assert exp.info["reward_reason"] == "raised RuntimeError: the judge is down"
    with pytest.raises(ValueError, match="has no 'prompt'"):
        await rollout(workflow, agent_engine, [Task(id="t", payload={"question": "Hi"})])


def test_verifiers_loading_errors_and_signal_handlers(as_env_package):
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        env = load_vf_environment("echo-env")  # verifiers installs handlers of its own
        assert isinstance(env, vf.SingleTurnEnv) and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
    with pytest.raises(ValueError, match="workflow_args.env 'no-such-env-x'"):
        load_vf_environment("no-such-env-x")
    with pytest.raises(ValueError, match="has no nope"):
        load_vf_environment(f"{HERE}:nope")
    with pytest.raises(ValueError, match="not a verifiers Environment"):
        load_vf_environment(f"{HERE}:brevity", {"completion": [{"content": ""}]})
    with pytest.raises(ValueError, match=r"env_args \['bogus'\]"):
        load_vf_environment(f"{HERE}:load_environment", {"bogus": 1})
    with pytest.raises(ConfigError, match="master.taskset.split"):
        read_taskset("echo-env", split="test")
    with pytest.raises(ConfigError, match="master.taskset.path 'echo-env'.*keyword argument 'colour'"):
        read_taskset("echo-env?colour=red")
    with pytest.raises(ConfigError, match="'weight' is not key=value"):
        read_taskset("echo-env?weight")
    assert parse_source('e?n=5&flag=true&name="x y"&word=hard&xs=[1,2]&q=a%26b') == (
        "e", {"n": 5, "flag": True, "name": "x y", "word": "hard", "xs": [1, 2], "q": "a&b"})
    with pytest.raises(ValueError, match="workflow_args for Verifiers: env"):
        Verifiers(None, {})


def test_registered_by_name():
    load_installed()
    assert WORKFLOWS.declares("verifiers") == {"endpoint": True}
    assert WORKFLOWS.declares("gym") == {"endpoint": True}
    assert WORKFLOWS.get("verifiers") is Verifiers and WORKFLOWS.get("gym") is Gym
    assert TASKSET_READERS.get("verifiers") is read_taskset


# -- Gymnasium ----------------------------------------------------------------------------------

def game_of(engine, exp) -> LetterGame:
    """A game instance that played this experience: its first observation is in the prompt and
    its actions are the experience's turns (greedy episodes of one task play alike)."""
    prompt = engine.tokenizer.decode(exp.tokens[:exp.prompt_len].tolist())
    actions = [model_text(engine, ids) for m, ids in turns(exp) if m == 1]
    games = [g for g in GAMES if g.observations[0] in prompt and g.actions == actions]
    assert games, f"no game played {actions}"
    return games[0]


async def test_gym_text_game_played_turn_by_turn(agent_engine):
    GAMES.clear()
    workflow = Gym(agent_engine.tokenizer, {"env": f"{HERE}:LetterGame",
                                            "env_args": {"rounds": 2}})
    tasks = [Task(id="a", payload={"letter": "a", "seed": 1}),
             Task(id="x", payload={"letter": "4", "seed": 2})]
    experiences = await rollout(workflow, agent_engine, tasks)
    assert len(experiences) == 4 and len(GAMES) == 4 and all(g.closed for g in GAMES)
    rewards = set()
    for exp in experiences:
        game = game_of(agent_engine, exp)
        assert len(game.actions) == 2
        assert exp.info["rule"] == "chained" and exp.info["calls"] == 2
        runs = turns(exp)
        assert [m for m, _ in runs] == [1, 0, 1]
        # the first observation is the prompt, the second is between the two turns, masked
        prompt = agent_engine.tokenizer.decode(exp.tokens[:exp.prompt_len].tolist())
        assert game.observations[0] in prompt
        assert game.observations[1] in agent_engine.tokenizer.decode(runs[1][1])
        assert exp.reward == pytest.approx(sum(game.rewards))
        assert exp.rewards == pytest.approx({"reward": sum(game.rewards),
                                             "return": sum(game.rewards),
                                             "last": game.rewards[-1], "steps": 2.0,
                                             "terminated": 1.0})
        rewards.add(exp.reward)
    assert rewards <= {2.0, 0.75, -0.5}


async def test_gym_last_reward_failures_and_registered_name(agent_engine):
    GAMES.clear()
    ENVIRONMENTS.register("letter_game_test", LetterGame)
    try:
        workflow = Gym(agent_engine.tokenizer, {"env": "letter_game_test", "reward": "last",
                                                "env_args": {"rounds": 3}, "max_turns": 2})
        [exp, _] = await rollout(workflow, agent_engine, [Task(id="a", payload={"letter": "a"})])
    finally:
        ENVIRONMENTS.unregister("letter_game_test")
    game = game_of(agent_engine, exp)
    assert len(game.actions) == 2  # max_turns ends it before the game does
    assert exp.reward == game.rewards[-1] and exp.rewards["terminated"] == 0.0

    broken = Gym(agent_engine.tokenizer, {"env": f"{HERE}:BrokenGame"})
    numbers = Gym(agent_engine.tokenizer, {"env": f"{HERE}:NumberGame"})
    tasks = [Task(id="a", payload={"letter": "a"})]
    for workflow, reason in [(broken, "BrokenGame.step raised RuntimeError: the board fell over"),
                             (numbers, "NumberGame.step returned a int observation")]:
        experiences = await rollout(workflow, agent_engine, tasks, repeat_times=1)
        [exp] = experiences  # the call the model made is still an experience, scored 0
        assert exp.reward == 0 and reason in exp.info["reward_reason"]


def test_gym_bad_args():
    with pytest.raises(ValueError, match="cannot import"):
        Gym(None, {"env": "no_such_module_y:Env"})
    with pytest.raises(ValueError, match="unknown environment 'nothing'"):
        Gym(None, {"env": "nothing"})
    with pytest.raises(ValueError, match="run it with the multi_turn workflow"):
        Gym(None, {"env": "guess_number"})
    with pytest.raises(ValueError, match="not a Gymnasium-style environment"):
        Gym(None, {"env": f"{HERE}:brevity"})
    with pytest.raises(ValueError, match="env_args for .*LetterGame.*colour"):
        Gym(None, {"env": f"{HERE}:LetterGame", "env_args": {"colour": "red"}})
