"""The vision path through the real multi-process system (issue 26, docs/vision.md): `tandem up`
on the tiny random Qwen2-VL with the circles task, every assertion read from the run dir alone.

The task images reach the buffer once each, the experiences name them, the trainer builds
their inputs (`batch/images`), the placeholders stay out of the action mask, and the trainer's
logprobs agree with the engine's (`mismatch/kl`). No SFT: a random policy is enough to carry
images through every component, and the synchronous preset rolls step s out on version s, so
the run is the same every time.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from processes import run_group

import resume_check
from tandem.buffer.rows import from_row
from tandem.common.images import image_hash, load_image
from tandem.common.trace import read_trace
from tandem.master.vision_task import counting_tasks

pytestmark = pytest.mark.slow
TANDEM = str(Path(sys.executable).parent / "tandem")
STEPS = 3
TASKS = 4  # fewer than the 2 x 3 tasks the run leases: images repeat, the buffer stores each once
PLACEHOLDERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def write_config(tmp_path: Path, model_dir: Path) -> tuple[Path, list[dict]]:
    data = tmp_path / "data"
    rows = counting_tasks(data, "train", TASKS, seed=0)
    taskset = data / "train.jsonl"
    taskset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "name": "vision-e2e", "run_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"path": str(model_dir)},
        "sync": {"preset": "synchronous", "timeout": 60},
        "master": {"total_steps": STEPS,
                   "taskset": {"path": str(taskset), "seed": 0, "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow": "single_turn",
                       "workflow_args": {"reward_fn": "vision", "answer_key": "truth"},
                       "sampling": {"temperature": 1.0, "max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-3, "advantage": "grpo", "loss": "ppo_clip"},
        "reward": {"functions": {"vision": 1.0}},
        "buffer": {"keep_consumed": 1000},  # the experiences stay for the checks below
        "transport": {"liveness": 30.0},
        "logging": {"level": "warning"},
        "up": {"run_timeout": 120, "timeline": False},
    }
    path = tmp_path / "vision.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, rows


def stored(run_dir: Path) -> tuple[list, dict[str, bytes], dict[str, int]]:
    """The buffer's experiences, its images by hash, and the step that consumed each group."""
    db = sqlite3.connect(f"file:{run_dir / 'buffer.sqlite'}?mode=ro", uri=True)
    try:
        experiences = [from_row(*row) for row in db.execute(
            "SELECT id, group_id, meta, tokens, action_mask, logprobs, token_versions, images "
            "FROM experiences")]
        images = dict(db.execute("SELECT hash, data FROM images"))
        steps = dict(db.execute("SELECT group_id, step FROM uses"))
    finally:
        db.close()
    return experiences, images, steps


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in events.Scalars(tag)}


@pytest.mark.timeout(300)
def test_images_flow_from_task_to_trainer_through_tandem_up(tmp_path, tiny_vlm_dir):
    config, rows = write_config(tmp_path, tiny_vlm_dir)
    run_dir = tmp_path / "run"
    proc = run_group([TANDEM, "up", str(config), "--plain"], timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # every step trained once, and the master counted each
    spans = read_trace(run_dir)
    trains = sorted((s for s in spans if s["kind"] == "train"), key=lambda s: s["step"])
    assert [s["step"] for s in trains] == list(range(STEPS))
    assert resume_check.master_steps(run_dir) == STEPS

    experiences, images, step_of = stored(run_dir)
    assert len(experiences) == STEPS * 2 * 2  # steps x batch_size x repeat_times
    # each distinct image once, named by its content hash; every experience names its task's
    # (the rows' task ids are their indices: the format names no id column)
    by_task = {str(i): image_hash(load_image(r["messages"][0]["content"][0]["image"],
                                             config.parent / "data")) for i, r in enumerate(rows)}
    used = {by_task[e.task_id] for e in experiences}
    assert len(used) < STEPS * 2  # the run leased a task twice: dedup had work to do
    assert set(images) == used
    assert all(image_hash(data) == h for h, data in images.items())
    for e in experiences:
        assert e.images == [by_task[e.task_id]], (e.id, e.images)

    # the placeholders are in the prompt, widened (16 per 64x64 image), and never in the mask
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_vlm_dir))
    ids = {tokenizer.convert_tokens_to_ids(t) for t in PLACEHOLDERS}
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for e in experiences:
        tokens = e.tokens.tolist()
        mask = [0] * e.prompt_len + e.action_mask.tolist()
        assert tokens[:e.prompt_len].count(pad) == 16, e.id
        assert all(not m for t, m in zip(tokens, mask) if t in ids), e.id
        assert any(mask), e.id  # the response was trained on

    # the images reached the trainer: each step built the inputs of the images its groups show
    shown: dict[int, set[str]] = defaultdict(set)
    for e in experiences:
        shown[step_of[e.group_id]].update(e.images)
    # TensorBoard's step is the learner's count after the step (step s is logged at s + 1)
    assert scalars(run_dir, "batch/images") == {s + 1: len(shown[s]) for s in range(STEPS)}

    # engine and trainer logprobs agree on the same weights, every step
    for span in trains:
        assert span["attrs"]["mismatch_kl"] < 1e-3, span
