"""The run-dir check without processes (tandem.common.runrecord): which keys count as a
difference, which may change on `--resume`, and the one line each case prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.common.config import load_config
from tandem.common.runrecord import (
    Difference,
    RunDirTaken,
    RunRecord,
    check_against,
    differences,
    flatten,
    newest_checkpoint,
    operational,
    recorded_config,
)

BASE = ["run_dir=runs/x", "master.total_steps=8", "master.address=tcp://127.0.0.1:5550"]


def config(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def record(trainer_steps: int = 8, total_steps: int = 8, run_config=None) -> RunRecord:
    data = recorded_config(config()) if run_config is None else run_config
    return RunRecord("run-1", total_steps, data, trainer_steps)


def test_flatten_names_list_items_by_index():
    assert flatten({"a": {"b": 1, "c": [{"d": 2}, 3]}, "e": [], "f": {}}) == {
        "a.b": 1, "a.c.0.d": 2, "a.c.1": 3, "e": [], "f": {}}


@pytest.mark.parametrize("key", [
    "logging.level", "logging.metrics.port", "master.address", "buffer.address",
    "transport.liveness", "up.restart", "placement.cores", "sync.timeout", "run_dir",
    "explorers.0.engine.device", "trainer.checkpoint_every", "weights.transport"])
def test_keys_that_do_not_change_the_run_are_no_difference(key):
    assert operational(key)


@pytest.mark.parametrize("key", [
    "trainer.lr", "master.total_steps", "seed", "model.path", "sync.preset",
    "explorers.0.batch_size", "explorers.0.sampling.temperature", "reward.functions.k12",
    "master.taskset.path", "trainer.loss.name"])
def test_keys_that_change_the_run_are_a_difference(key):
    assert not operational(key)


def test_only_semantic_keys_differ():
    old = recorded_config(config())
    new = recorded_config(config("trainer.lr=1e-4", "logging.level=debug",
                                 "logging.metrics.port=9999", "master.address=tcp://127.0.0.1:7"))
    assert differences(old, new) == [Difference("trainer.lr", 1e-5, 1e-4)]
    assert differences(old, old) == []


def test_a_key_on_one_side_only_is_a_difference():
    old = recorded_config(config())
    new = {**old, "explorers": [*old["explorers"], {"name": "explorer-1"}]}
    diffs = {d.key: d for d in differences(old, new)}
    assert "explorers.1.name" in diffs and str(diffs["explorers.1.name"]) == (
        "explorers.1.name (absent) (run) -> 'explorer-1' (given)")


def test_total_steps_may_only_go_up_on_resume():
    assert Difference("master.total_steps", 8, 12).refusal() is None
    assert Difference("master.total_steps", 8, 5).refusal() == "may only go up on resume"
    assert Difference("trainer.lr", 1e-5, 1e-4).refusal() == "cannot change on resume"


def test_the_same_config_continues_or_is_finished():
    joined = check_against(record(trainer_steps=3), config(), resume=False)
    assert not joined.finished and joined.changed == ()
    assert joined.line("runs/x") == "continuing run run-1 in runs/x at step 3 of 8"
    done = check_against(record(), config("logging.level=debug"), resume=False)
    assert done.finished and done.line("runs/x").startswith(
        "run run-1 in runs/x is finished (8 of 8 trainer steps); nothing to do")


def test_a_run_counted_to_the_end_without_its_checkpoint_goes_on(tmp_path):
    """Everything killed between the master's last count and the trainer's checkpoint: the
    journal says 8 of 8, the disk holds 5 (or nothing). The run is not finished; its trainer
    retrains the steps after its checkpoint."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000005").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000005" / "trainer_state.json").write_text('{"step": 5}')
    (run_dir / "checkpoints" / "step_00000008").mkdir()  # not complete: no trainer_state.json
    assert newest_checkpoint(run_dir / "checkpoints") == (5, run_dir / "checkpoints" /
                                                          "step_00000005")
    short = replace(check_against(record(), config(), resume=True), checkpointed=5)
    assert not short.finished
    assert short.line("runs/x") == ("continuing run run-1 in runs/x at step 8 of 8 (the newest "
                                    "checkpoint holds 5: steps 5..7 are retrained)")
    assert not replace(short, checkpointed=0).finished
    assert replace(short, checkpointed=8).finished


def test_a_change_without_resume_names_each_key_and_both_ways_out():
    with pytest.raises(RunDirTaken) as caught:
        check_against(record(), config("trainer.lr=1e-4", "master.total_steps=12"),
                      resume=False)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("run_dir runs/x holds run run-1 (step 8 of 8)")
    assert "master.total_steps 8 (run) -> 12 (given)" in line
    assert "trainer.lr 1e-05 (run) -> 0.0001 (given)" in line
    assert "a new run_dir" in line and "--resume" in line
    assert "master.total_steps (upward)" in line


def test_resume_accepts_a_longer_run_and_nothing_else():
    joined = check_against(record(), config("master.total_steps=12"), resume=True)
    assert not joined.finished and joined.total_steps == 12
    assert joined.line("runs/x") == ("continuing run run-1 in runs/x at step 8 of 12 "
                                     "(master.total_steps 8 (run) -> 12 (given))")
    with pytest.raises(RunDirTaken, match=r"master.total_steps 8 \(run\) -> 5 \(given\) may "
                                          "only go up on resume"):
        check_against(record(), config("master.total_steps=5"), resume=True)
    with pytest.raises(RunDirTaken, match=r"trainer.lr .* cannot change on resume"):
        check_against(record(), config("master.total_steps=12", "trainer.lr=1e-4"), resume=True)


def test_a_length_from_the_taskset_is_the_journal_length(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"prompt": "{i}", "answer": "{i}"}}\n' for i in range(8)))
    derived = load_config(None, ["run_dir=runs/x", f"master.taskset.path={tasks}"])
    run = RunRecord("run-1", 2, recorded_config(derived), 1)
    assert check_against(run, derived, resume=False).line("runs/x").endswith("step 1 of 2")
    longer = derived.model_copy(update={"master": derived.master.model_copy(
        update={"total_steps": 3})})
    assert check_against(run, longer, resume=True).total_steps == 3


def test_an_older_journal_compares_its_length_only():
    old = RunRecord("run-1", 8, None, 8)
    assert check_against(old, config("trainer.lr=1e-4"), resume=False).finished
    with pytest.raises(RunDirTaken, match="may only go up"):
        check_against(old, config("master.total_steps=5"), resume=True)
