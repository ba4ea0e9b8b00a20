"""The eval role (`explorers[].role: eval`): its config errors, and a `tandem up` run where a
rollout explorer trains and a second explorer only evaluates the published versions."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.common.config import RunConfig, validate
from tandem.common.errors import ConfigError
from tandem.common.trace import read_trace
from tandem.master.quickstart import reversal_tasks, write_jsonl
from tandem.master.service import total_steps_for

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
        "transport": {"liveness": 30.0},
        "logging": {"level": "warning"},
        "sync": {"timeout": 60},
        "up": {"run_timeout": 120},
    }
    if tasksets:
        path = write_jsonl(heldout[:2], tmp_path / "heldout.jsonl")
        data["eval"] = {"tasksets": [{"name": "heldout", "path": str(path)}],
                        "modes": ["greedy"], "every": 1, "final_wait": 60}
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


@pytest.mark.slow
def test_a_run_with_an_eval_explorer_finishes_and_it_evaluates_each_version(
        tmp_path, tiny_model_dir):
    from tandem.master.up import run_up

    cfg = config(tmp_path, tiny_model_dir)
    assert run_up(cfg, live=False) == 0
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
