"""The plugin example (examples/plugins/digit_retry) as a user meets it: its package installed
by pip outside the repository, found through its entry point alone, and learned by a real
`tandem up`; the plugin mistakes a user makes, each one line and exit 2; and
docs/extending.md quoting the example's files as they are.

Nothing here imports the plugin into pytest's own process (its names would stay registered
for the tests after this one): every check runs `tandem` with the plugin's folder on
PYTHONPATH, which `tandem up`'s children and the reward worker processes inherit.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from processes import run_group
from backstop import BACKSTOP

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugins" / "digit_retry"
TANDEM = str(Path(sys.executable).parent / "tandem")
STEPS = 30
WINDOW = 10  # rollout steps averaged at the start and at the end


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    """The example copied out of the repository and installed by pip into a folder of its own;
    `env` puts that folder (package and dist-info, so the entry point too) on PYTHONPATH."""
    root = tmp_path_factory.mktemp("plugin")
    source = root / "digit_retry"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("__pycache__"))
    site = root / "site"
    # hatchling comes from this venv (tandem-master[test]): nothing is downloaded
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=BACKSTOP)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (site / "digit_retry" / "plugin.py").exists()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"source": source, "env": {**os.environ, "PYTHONPATH": path}}


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> Path:
    """The model `make run` warm-starts (runs/quickstart/model-sft), built the same way."""
    from tandem.master.quickstart import MODEL, reversal_tasks, warm_start
    from tandem.weights.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("model")
    build_tiny_model(root / "init", seed=0, **MODEL)
    warm_start(root / "init", root / "sft", reversal_tasks(0)[0], steps=80, seed=0)
    return root / "sft"


def stored_experiences(run_dir: Path) -> list:
    """Every experience the buffer stored (kept after training: buffer.keep_consumed)."""
    from tandem.buffer.rows import from_row

    db = sqlite3.connect(run_dir / "buffer.sqlite")
    try:
        rows = db.execute("SELECT id, group_id, meta, tokens, action_mask, logprobs, "
                          "token_versions FROM experiences").fetchall()
    finally:
        db.close()
    return [from_row(*row) for row in rows]


def scalars(run_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [e.value for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


@pytest.mark.slow
@pytest.mark.timeout(1560)
def test_plugin_task_learns_through_tandem_up(tmp_path, plugin, warm_model):
    from transformers import AutoTokenizer

    from tandem.common.trace import read_trace

    run_dir = tmp_path / "run"
    source = plugin["source"]
    overrides = {
        "run_dir": run_dir, "model.path": warm_model,
        "master.taskset.path": source / "data" / "train.jsonl",
        "master.total_steps": STEPS, "buffer.keep_consumed": 1_000_000, "up.timeline": "false",
        "up.run_timeout": 1200,
    }
    argv = [TANDEM, "up", str(source / "run.yaml")]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    # 10-20 s of run on 2 quiet cores (and about 20 s for the model above); the bound is for
    # a busy machine. Run from outside the repository: the plugin comes from `site` alone.
    proc = run_group(argv, timeout=1500, stall=120, cwd=tmp_path, env=plugin["env"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    spans = read_trace(run_dir)
    rollouts = sorted((s for s in spans if s["kind"] == "rollout"), key=lambda s: s["step"])
    assert [s["step"] for s in rollouts] == list(range(STEPS))
    component_pids = {s["pid"] for s in spans}
    experiences = stored_experiences(run_dir)
    assert len(experiences) == STEPS * 16 * 8  # run.yaml's batch_size x repeat_times
    tokenizer = AutoTokenizer.from_pretrained(str(warm_model))

    hints = 0
    worker_pids = set()
    for e in experiences:
        # the format: task ids from the data's `uid` column, prompts made from `number`
        assert re.fullmatch(r"n\d{3}", e.task_id), e.task_id
        prompt = tokenizer.decode(e.tokens[:e.prompt_len].tolist(), skip_special_tokens=True)
        assert prompt == f"rev {e.task_id[1:]}=", prompt
        # the environment and the workflow built on multi_turn
        assert e.info["env"] == "digit_retry" and 1 <= e.info["turns"] <= 2, e.info
        assert 1 <= len(e.info["attempts"]) <= 2
        assert {"digit_match.first", "digit_match.second", "env.solved"} <= set(e.rewards)
        # the environment's hint (not the model's: action mask 0) before a second attempt
        replies = [t for t, a in zip(e.tokens[e.prompt_len:].tolist(), e.action_mask.tolist())
                   if not a]
        if len(e.info["attempts"]) == 2:
            hints += 1
            reply = tokenizer.decode(replies, skip_special_tokens=True)
            assert re.fullmatch(rf" [\d_]{{3}}\n{re.escape(prompt)}", reply), reply
        # the reward ran isolated: in a worker process, none of the run's components
        found = re.search(r"\(pid (\d+)\)$", e.info["reward_reason"])
        assert found, e.info["reward_reason"]
        worker_pids.add(int(found.group(1)))
        assert e.reward == pytest.approx(e.rewards["digit_match"])
    assert hints > 0
    assert worker_pids and not worker_pids & component_pids, (worker_pids, component_pids)
    # the loss: the trainer logged the cispo loss's own metrics at every step
    assert len(scalars(run_dir, "cispo/weight_mean")) == STEPS

    # The reward rose: the first and the last WINDOW steps' mean rollout reward. The
    # synchronous preset rolls step e out on version e whatever the timing, so a seed gives
    # the same rewards every time on one machine (seed 0: +0.082); over seeds 0-7 this run
    # rose by 0.049 to 0.089 (mean 0.073), so 0.03 holds on other hardware too.
    rewards = [s["attrs"]["reward_mean"] for s in rollouts]
    early, late = statistics.mean(rewards[:WINDOW]), statistics.mean(rewards[-WINDOW:])
    assert late >= early + 0.03, rewards


MISTAKES = {
    # a plugin registering a name another plugin holds
    "taken": ("from tandem.reward import PureReward, register, result\n\n\n"
              "@register('digit_match')\n"
              "class ExactDigits(PureReward):\n"
              "    def score(self, item):\n"
              "        return result(item.response == item.truth, 'exact')\n",
              ["plugins[0]", "taken.py", "reward function 'digit_match' is registered twice",
               "by digit_retry (digit_retry.plugin"]),
    # a plugin file that fails to import
    "broken": ("import digit_retry.no_such_module\n",
               ["plugins[0]", "broken.py", "failed to import", "ModuleNotFoundError"]),
}


@pytest.mark.parametrize("case", ["taken", "broken", "reward_fn", "loss_param", "bad_row"])
def test_plugin_mistakes_exit_2_with_one_line(tmp_path, plugin, case):
    argv = [TANDEM, "up", str(plugin["source"] / "run.yaml")]
    if case in MISTAKES:
        code, expected = MISTAKES[case]
        path = tmp_path / f"{case}.py"
        path.write_text(code)
        argv += ["--set", f"plugins=[{path}]"]
    elif case == "reward_fn":  # a function no plugin registers (the plugin's own is listed)
        argv += ["--set", "explorers.0.workflow_args.reward_fn=digit_mach"]
        expected = ["explorers[explorer-0].workflow_args.reward_fn: unknown reward function "
                    "'digit_mach'", "digit_match"]
    elif case == "loss_param":  # the loss's own parameter, checked by the model it declares
        argv += ["--set", "trainer.loss.max_weight=-1"]
        expected = ["trainer.loss.max_weight", "greater than 0"]
    else:  # a row the plugin's format refuses: tandem up reads every row before starting
        data = tmp_path / "train.jsonl"
        data.write_text('{"uid": "n1", "number": 123, "reversed": "321"}\n'
                        '{"uid": "n2", "number": "4x5", "reversed": "5x4"}\n')
        argv += ["--set", f"master.taskset.path={data}"]
        expected = [f"master.taskset.format: {data} row 2: column 'number' must be a whole "
                    "number, got '4x5'"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=BACKSTOP, cwd=tmp_path,
                          env=plugin["env"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem up: "), proc.stderr
    for part in expected:
        assert part in lines[0], lines[0]


def test_committed_data_is_what_the_generator_writes(tmp_path, plugin):
    proc = subprocess.run([sys.executable, "-m", "digit_retry.data", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=BACKSTOP, env=plugin["env"])
    assert proc.returncode == 0, proc.stderr
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / "data" / name).read_text(), name


def test_extending_doc_quotes_the_example_as_it_is():
    """Each code block of docs/extending.md marked with `<!-- file: PATH -->` is that file."""
    text = (ROOT / "docs" / "extending.md").read_text()
    quoted = re.findall(r"<!-- file: (\S+) -->\n```[a-z]*\n(.*?)```\n", text, re.DOTALL)
    assert {path for path, _ in quoted} >= {
        f"examples/plugins/digit_retry/{p}" for p in (
            "pyproject.toml", "run.yaml", "src/digit_retry/plugin.py",
            "src/digit_retry/taskset.py", "src/digit_retry/environment.py",
            "src/digit_retry/reward.py", "src/digit_retry/workflow.py",
            "src/digit_retry/loss.py")}
    for path, block in quoted:
        assert block == (ROOT / path).read_text(), f"docs/extending.md's copy of {path} differs"
