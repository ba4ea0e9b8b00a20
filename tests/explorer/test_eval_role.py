"""The eval role (`explorers[].role: eval`): its config errors, and a `tandem up` run where a
rollout explorer trains and a second explorer only evaluates the published versions."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from backstop import BACKSTOP
from tandem.common.config import RunConfig, validate
from tandem.common.errors import ConfigError, WaitTimeout
from tandem.common.messages.master import Stop, WeightsPublished
from tandem.common.pubsub import Event
from tandem.common.trace import Tracer, read_trace
from tandem.explorer.eval_role import WeightFollower
from tandem.master.quickstart import reversal_tasks, write_jsonl
from tandem.master.service import total_steps_for
from tandem.weights import WeightsError

STEPS = 4


def config(tmp_path: Path, model: Path | str = "model", *, roles=("rollout", "eval"),
           tasksets: bool = True, **extra) -> RunConfig:
    train, heldout = reversal_tasks(0)
    data: dict = {
        "run_dir": str(tmp_path / "run"), "model": {"path": str(model)},
        "master": {"total_steps": STEPS,
                   "taskset": {"path": str(write_jsonl(train[:64], tmp_path / "train.jsonl")),
                               "epochs": 10}},
        "explorers": [{"name": f"{role}-{i}", "role": role, "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}} for i, role in enumerate(roles)],
        "trainer": {"groups_per_step": 2, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": BACKSTOP},
        "logging": {"level": "warning"},
        "sync": {"timeout": BACKSTOP},
        "up": {"run_timeout": BACKSTOP, "start_timeout": BACKSTOP, "stop_timeout": BACKSTOP,
               "timeline": False},
    }
    if tasksets:
        path = write_jsonl(heldout[:2], tmp_path / "heldout.jsonl")
        data["eval"] = {"tasksets": [{"name": "heldout", "path": str(path)}],
                        "modes": ["greedy"], "every": 1, "final_wait": BACKSTOP}
    for key, value in extra.items():
        section, _, field = key.partition("__")
        data.setdefault(section, {})[field] = value
    return validate(RunConfig, data)


def one_line_error(make) -> str:
    with pytest.raises(ConfigError) as err:
        make()
    [message] = err.value.errors
    assert "\n" not in message
    return message


def test_the_eval_explorer_is_not_a_rollout_explorer(tmp_path):
    cfg = config(tmp_path)
    assert [e.name for e in cfg.rollout_explorers] == ["rollout-0"]
    assert cfg.evaluating_explorer == "eval-1"  # not explorers[0]
    # a step is the rollout explorer's 2 tasks: 64 tasks fill 32 steps (16 counting both)
    unbounded = cfg.model_copy(update={"master": cfg.master.model_copy(
        update={"total_steps": None})})
    assert total_steps_for(unbounded, SimpleNamespace(total=64)) == 32
    assert "eval-1" not in cfg.terms("trainer", "trainer")["explorers"]
    assert cfg.terms("evaluator", "eval-1")["model.path"] == "model"


def test_role_eval_without_an_eval_section_names_the_key(tmp_path):
    message = one_line_error(lambda: config(tmp_path, tasksets=False))
    assert "explorers[eval-1].role: eval needs an eval section with tasksets" in message


def test_every_explorer_eval_names_the_key(tmp_path):
    message = one_line_error(lambda: config(tmp_path, roles=("eval", "eval")))
    assert "explorers[*].role: every explorer has role eval" in message


def test_eval_role_conflicts_name_their_keys(tmp_path):
    assert "explorers[eval-2].role: eval, but eval-1 already is" in one_line_error(
        lambda: config(tmp_path, roles=("rollout", "eval", "eval")))
    assert "eval.explorer: rollout-0 is a rollout explorer" in one_line_error(
        lambda: config(tmp_path, eval__explorer="rollout-0"))
    assert "sync.method: nccl does not write" in one_line_error(
        lambda: config(tmp_path, sync__method="nccl"))


class ScriptedRun:
    """What WeightFollower talks to, scripted: the master's events arrive in batches (each
    batch queued at once, as while an evaluation runs); loads and evaluations are recorded."""

    def __init__(self, cfg: RunConfig, batches: list[list]):
        from tandem.explorer.evaluation import Evaluator

        self.config = cfg
        self.evaluator = Evaluator(cfg, "eval-1")
        self.engine = SimpleNamespace(version=0)
        self.tracer = Tracer(None, "eval-1")
        self.loader = SimpleNamespace(load=self._load)
        self.subscriber = SimpleNamespace(recv=self._recv, address="tcp://scripted")
        self.batches, self.queue = list(batches), []
        self.evaluated: list[tuple[int, bool]] = []
        self.missing: set[int] = set()
        self.loads: list[int] = []

    async def _recv(self, timeout, *, what="", timeout_key=""):
        if not self.queue and timeout >= 0.1 and self.batches:
            self.queue = [Event("weights", n, msg) for n, msg in enumerate(self.batches.pop(0))]
        if not self.queue:
            raise WaitTimeout(f"no {what}")
        return self.queue.pop(0)

    async def _load(self, version, method):
        assert method == "checkpoint"
        self.loads.append(version)
        if version in self.missing:
            raise WeightsError(f"weights/v{version} is gone")
        self.engine.version = version
        return {}

    async def _evaluate(self, *, step, final=False):
        self.evaluated.append((self.engine.version, final))
        self.evaluator.last_version = self.engine.version

    def follower(self) -> WeightFollower:
        return WeightFollower(
            "eval-1", engine=self.engine, evaluator=self.evaluator, subscriber=self.subscriber,
            loader=self.loader, tracer=self.tracer, timeout=self.config.sync.timeout,
            evaluate=self._evaluate, stopping=lambda: False)


def published(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, method="checkpoint", path=f"weights/v{version}")


@pytest.mark.parametrize("every,expected", [
    (1, [(0, False), (1, False), (4, False), (5, True)]),  # 2..4 came together: only 4
    (3, [(0, False), (4, False), (5, True)]),  # 1 is not 3 past 0; 4 is
])
async def test_the_follower_evaluates_the_newest_version_every_n(tmp_path, every, expected):
    run = ScriptedRun(config(tmp_path, eval__every=every), [
        [published(1)], [published(2), published(3), published(4)], [published(5), Stop(
            reason="done")]])
    follower = run.follower()
    await follower.run()
    assert run.evaluated == expected
    assert follower.stop_reason == "done"


async def test_a_deleted_version_is_skipped_and_the_final_row_still_comes(tmp_path):
    run = ScriptedRun(config(tmp_path), [[published(1)], [published(2)], [published(2)],
                                         [Stop(reason="done")]])
    run.missing = {2}
    await run.follower().run()
    # v2 could not be loaded: no row for it, no second try until the end, and the final
    # evaluation scores v1, still held
    assert run.loads == [1, 2, 2]
    assert run.evaluated == [(0, False), (1, False), (1, True)]


@pytest.mark.slow
def test_a_run_with_an_eval_explorer_finishes_and_it_evaluates_each_version(
        tmp_path, tiny_model_dir):
    from tandem.master.up import run_up

    cfg = config(tmp_path, tiny_model_dir)
    assert run_up(cfg, live=False) == 0
    assert not (Path(cfg.run_dir) / "timeline.png").exists()  # up.timeline: false
    rows = [json.loads(line) for line in
            (Path(cfg.run_dir) / "eval.jsonl").read_text().splitlines()]
    assert rows and {r["explorer"] for r in rows} == {"eval-1"}, rows
    versions = [r["version"] for r in rows]
    assert versions == sorted(versions) and versions[0] == 0, versions
    assert len(set(versions)) >= 2, versions  # it followed published weights
    # the trainer publishes no version after its last step: the newest is STEPS - 1
    assert rows[-1]["final"] and rows[-1]["version"] == STEPS - 1, rows[-1]
    spans = read_trace(cfg.run_dir)
    kinds = {(s["component"], s["kind"]) for s in spans}
    assert ("eval-1", "eval") in kinds and ("eval-1", "rollout") not in kinds
    assert ("rollout-0", "eval") not in kinds
    trained = sorted(s["step"] for s in spans if s["kind"] == "train")
    assert trained == list(range(STEPS))
