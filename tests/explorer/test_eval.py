"""Evaluation: pass@k math, an Evaluator's rows on the tiny model, `tandem eval`, the config
error for an eval taskset without the answer the reward needs."""

from __future__ import annotations

import json
import sys

import pytest

from backstop import BACKSTOP
from processes import run_group
from tandem.common.config import RunConfig, load_config
from tandem.common.errors import ConfigError
from tandem.explorer.evaluation import Evaluator, pass_at_k, summarise


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0  # any 4 of 4 include the right one
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 3) == pytest.approx(1 - 35 / 120)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_summarise_counts_answers_and_tasks():
    # task a: 2 of 4 right; task b: none right (rewards below correct_at count as wrong)
    out = summarise([[1, 0, 1, 0], [0.5, 0, 0, 0]], correct_at=1.0, ks=[1, 2, 4, 8])
    assert out["reward_mean"] == pytest.approx(2.5 / 8)
    assert out["accuracy"] == pytest.approx(2 / 8)
    assert out["pass@1"] == pytest.approx((0.5 + 0) / 2)
    assert out["pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)
    assert out["pass@4"] == pytest.approx(0.5)
    assert "pass@8" not in out  # more than the answers per task


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path, model, heldout, **eval_args) -> RunConfig:
    return RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(model)},
        "explorers": [{"name": "e0", "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 4}}],
        "reward": {"functions": {"k12": 1.0}},
        "eval": {"tasksets": [{"name": "heldout", "path": str(heldout)}], **eval_args}})


@pytest.fixture
def heldout(tmp_path, engine):
    """Tasks whose answer is what the tiny model says greedily to the first two prompts, and
    something it never says to the third: greedy accuracy is 2/3 by construction."""
    import asyncio

    from tandem.explorer.sampling import SamplingParams

    prompts = ["rev 12=", "rev 345=", "rev 6789="]
    done = asyncio.run(engine.generate(prompts, 1, SamplingParams(temperature=0, max_tokens=4)))
    answers = [done[0][0].text.strip(), done[1][0].text.strip(), "no such answer"]
    assert answers[0] and answers[1], "the tiny model said nothing greedily"
    return _write(tmp_path / "heldout.jsonl", [
        {"prompt": p, "truth": {"type": "short", "answer": a}} for p, a in zip(prompts, answers)])


async def test_evaluator_rows_carry_the_version_and_land_in_eval_jsonl(tmp_path, engine,
                                                                        heldout):
    from tandem.explorer.rewards import InProcessScorer
    from tandem.explorer.workflows import create_workflow

    config = _config(tmp_path, engine_path(engine), heldout, every=5, repeat_times=3)
    ev = Evaluator(config, "e0")
    workflow = create_workflow("single_turn", engine.tokenizer, config.explorers[0].workflow_args)
    scorer = InProcessScorer(config.reward)
    try:
        assert ev.due(0)  # at_start
        first = await ev.evaluate(engine, workflow, scorer, version=0, step=0)
        assert not ev.due(4) and ev.due(5)
        again = await ev.evaluate(engine, workflow, scorer, version=7, step=7)
        final = await ev.evaluate(engine, workflow, scorer, version=7, step=9, final=True)
    finally:
        await scorer.close()
    m = first[0]["metrics"]
    assert m["greedy/accuracy"] == pytest.approx(2 / 3)
    assert m["greedy/reward_mean"] == pytest.approx(2 / 3)
    assert set(m) == {"greedy/reward_mean", "greedy/accuracy", "sampled/reward_mean",
                      "sampled/accuracy", "sampled/pass@1", "sampled/pass@3"}
    assert m["sampled/pass@1"] == pytest.approx(m["sampled/accuracy"])
    assert m["sampled/pass@3"] >= m["sampled/pass@1"]
    # the same weights and seeds score the same at every evaluation
    assert again[0]["metrics"] == m
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(r["version"], r["step"], r["final"], r["taskset"], r["tasks"]) for r in rows] == [
        (0, 0, False, "heldout", 3), (7, 7, False, "heldout", 3), (7, 9, True, "heldout", 3)]
    assert final[0]["metrics"] == again[0]["metrics"]


def engine_path(engine):
    return engine.model.name_or_path


def test_an_eval_taskset_without_the_answer_key_is_a_config_error(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "rev 12=", "truth": "21"},
                                          {"prompt": "rev 34=", "answer": "43"}])
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "explorers: [{name: e0, workflow_args: {answer_key: truth}}]\n"
        f"eval: {{tasksets: [{{name: heldout, path: {bad}}}]}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    message = str(err.value)
    assert "eval.tasksets[0]" in message and "row 1" in message and "'truth'" in message
    assert "eval.answer_key" in message
    # an explicit eval.answer_key that every row has is fine
    _write(tmp_path / "good.jsonl", [{"prompt": "rev 12=", "answer": "21"}])
    ok = load_config(cfg, [f"eval.tasksets.0.path={tmp_path / 'good.jsonl'}",
                           "eval.answer_key=answer"])
    assert ok.eval.pass_k == [1, 4]


def test_tandem_eval_scores_a_checkpoint_alone(tmp_path, tiny_model_dir, heldout):
    import shutil

    step = tmp_path / "checkpoints" / "step_00000012"
    shutil.copytree(tiny_model_dir, step / "model")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\n"
        "explorers: [{name: e0, workflow_args: {reward_fn: k12, answer_key: truth}, "
        "sampling: {max_tokens: 4}}]\n"
        "reward: {functions: {k12: 1.0}}\n"
        f"eval: {{tasksets: [{{name: heldout, path: {heldout}}}], modes: [greedy]}}\n")
    # `tandem eval` runs the explorer's eval CLI as its child: a hang's bound stops both
    done = run_group(
        [sys.executable, "-m", "tandem.master.cli", "eval", str(cfg), "--checkpoint", str(step),
         "--json"], BACKSTOP)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["version"] == 12 and row["taskset"] == "heldout"
    assert row["metrics"] == {"greedy/reward_mean": pytest.approx(2 / 3),
                              "greedy/accuracy": pytest.approx(2 / 3)}
    written = json.loads((tmp_path / "run" / "eval.jsonl").read_text())
    assert written["version"] == 12 and written["checkpoint"] == str(step / "model")
    # a folder with no model is a usage error, in one line
    bad = run_group(
        [sys.executable, "-m", "tandem.master.cli", "eval", str(cfg), "--checkpoint",
         str(tmp_path / "checkpoints")], BACKSTOP)
    assert bad.returncode == 2 and "holds no Hugging Face model" in bad.stderr
    assert "no LoRA adapter" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_tandem_eval_forwards_its_arguments_and_help_to_the_explorer_cli(tmp_path):
    """`tandem eval` declares no option of its own: `--help` is the explorer CLI's, and a bad
    config is that CLI's one-line usage error."""
    tandem = [sys.executable, "-m", "tandem.master.cli", "eval"]
    shown = run_group([*tandem, "--help"], BACKSTOP)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("Usage: tandem eval [OPTIONS] CONFIG_PATH")
    for option in ("--checkpoint", "--set", "--out", "--version", "--json", "LoRA"):
        assert option in shown.stdout, option
    cfg = tmp_path / "run.yaml"
    cfg.write_text("eval: {repeat_times: 0}\n")
    bad = run_group([*tandem, str(cfg), "--checkpoint", str(tmp_path), "--json"], BACKSTOP)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("tandem eval: invalid config") and "eval.repeat_times" in bad.stderr


def test_an_eval_taskset_with_images_loads_them(tmp_path, tiny_model_dir):
    """A held-out taskset whose messages show images (paths relative to it) gives tasks that
    carry the images' bytes, as the training taskset's do: the engine needs them."""
    pytest.importorskip("PIL")
    from tandem.master.vision_task import write_taskset

    _, held = write_taskset(tmp_path / "data", seed=0, train=1, heldout=2)
    evaluator = Evaluator(_config(tmp_path, tiny_model_dir, held), "e0")
    (taskset,) = evaluator.tasksets
    assert [len(t.payload["images"]) for t in taskset.tasks] == [1, 1]
    assert all(t.payload["images"][0].startswith(b"\x89PNG") for t in taskset.tasks)
    assert taskset.tasks[0].payload["messages"][0]["content"][0] == {"type": "image"}
