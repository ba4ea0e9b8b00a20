"""The vision path through the real multi-process system (issue 26, docs/vision.md): `tandem up`
on a tiny Qwen2-VL with the "which colour?" task, every assertion read from the run dir alone.

The task images reach the buffer once each, the experiences name them, the trainer builds
their inputs (`batch/images`), the placeholders stay out of the action mask, the trainer's
logprobs agree with the engine's (`mismatch/kl`), and the reward rose. The model is warm-started
by 12 SFT steps of seed 0, enough for the format and a start on the colours (sampled reward
about 0.4, chance 1/3; other SFT seeds learn the colours outright, docs/vision.md), and GRPO
takes it to about 0.8 in 12 steps. Fixed seeds, an unshuffled taskset
whose colours take turns (each step asks for each colour equally often) and the synchronous
preset (step s rolled out on version s) make the run the same every time: the verdict counts
steps, never seconds.
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
from tandem.master.vision_task import colour_tasks
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
TANDEM = str(Path(sys.executable).parent / "tandem")
STEPS = 12
GROUPS = 6  # tasks per step (a multiple of the 3 colours), each rolled out REPEAT times
REPEAT = 6
TASKS = 24  # fewer than the 6 x 12 tasks the run leases: images repeat, the buffer stores each once
IMAGE_SIZE = 32  # 8-pixel patches merged 2 x 2: 4 placeholder tokens per image
K = 4  # the reward of the last K steps against the first K
# the tokens the images' embeddings replace, which no response may hold (engine and trainer give
# them a logit of -1e9); <|vision_start|> and <|vision_end|> are ordinary special tokens that a
# barely trained policy does sample now and then
PLACEHOLDERS = ("<|image_pad|>", "<|video_pad|>")


def write_tasks(folder: Path, n: int) -> Path:
    taskset = folder / "train.jsonl"
    rows = colour_tasks(folder, "train", n, seed=0, size=IMAGE_SIZE)
    taskset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return taskset


@pytest.fixture(scope="session")
def colour_vlm_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL at 32 x 32 pixels after 12 SFT steps (module docstring), built once
    per session."""
    from tandem.master.vision_quickstart import VLM, warm_start_vlm
    from tandem.weights.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("colour-vlm")
    build_tiny_vlm(root / "init", seed=0, **{**VLM, "image_size": IMAGE_SIZE})
    warm_start_vlm(root / "init", root / "sft", write_tasks(root / "data", 64), steps=12,
                   lr=3e-3, batch=16, seed=0)
    return root / "sft"


def write_config(tmp_path: Path, model_dir: Path) -> tuple[Path, list[dict]]:
    taskset = write_tasks(tmp_path / "data", TASKS)
    rows = [json.loads(line) for line in taskset.read_text().splitlines()]
    config = {
        "name": "vision-e2e", "run_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"path": str(model_dir)},
        "sync": {"preset": "synchronous", "timeout": BACKSTOP},
        "master": {"total_steps": STEPS,
                   "taskset": {"path": str(taskset), "shuffle": False, "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": GROUPS, "repeat_times": REPEAT,
                       "workflow": "single_turn",
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"temperature": 1.0, "max_tokens": 2}}],
        "trainer": {"groups_per_step": GROUPS, "lr": 1e-3, "advantage": "grpo",
                    "loss": "ppo_clip"},
        "reward": {"functions": {"k12": 1.0}},
        "buffer": {"keep_consumed": 1000},  # the experiences stay for the checks below
        "transport": {"liveness": BACKSTOP},
        "logging": {"level": "warning"},
        "up": {"run_timeout": 1200, "timeline": False},
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


@pytest.mark.timeout(1560)
def test_images_flow_from_task_to_trainer_and_the_reward_rises(tmp_path, colour_vlm_dir):
    config, rows = write_config(tmp_path, colour_vlm_dir)
    run_dir = tmp_path / "run"
    proc = run_group([TANDEM, "up", str(config), "--plain"], timeout=1500, stall=120,
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # every step trained once, and the master counted each
    spans = read_trace(run_dir)
    trains = sorted((s for s in spans if s["kind"] == "train"), key=lambda s: s["step"])
    assert [s["step"] for s in trains] == list(range(STEPS))
    assert resume_check.master_steps(run_dir) == STEPS

    experiences, images, step_of = stored(run_dir)
    assert len(experiences) == STEPS * GROUPS * REPEAT
    # each distinct image once, named by its content hash; every experience names its task's
    # (the rows' task ids are their indices: the format names no id column)
    by_task = {str(i): image_hash(load_image(r["messages"][0]["content"][0]["image"],
                                             config.parent / "data")) for i, r in enumerate(rows)}
    used = {by_task[e.task_id] for e in experiences}
    assert len(used) < STEPS * GROUPS  # the run leased a task twice: dedup had work to do
    assert set(images) == used
    assert all(image_hash(data) == h for h, data in images.items())
    for e in experiences:
        assert e.images == [by_task[e.task_id]], (e.id, e.images)

    # the placeholders are in the prompt, widened (4 per 32x32 image), and never in the mask
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(colour_vlm_dir))
    ids = {tokenizer.convert_tokens_to_ids(t) for t in PLACEHOLDERS}
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for e in experiences:
        tokens = e.tokens.tolist()
        mask = [0] * e.prompt_len + e.action_mask.tolist()
        assert tokens[:e.prompt_len].count(pad) == 4, e.id
        assert not ids & set(tokens[e.prompt_len:]), e.id
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

    # the reward rose: GRPO taught the policy the colours (every seed tried: docs/vision.md)
    rewards: dict[int, list[float]] = defaultdict(list)
    for e in experiences:
        rewards[step_of[e.group_id]].append(e.reward)
    mean = [sum(rewards[s]) / len(rewards[s]) for s in range(STEPS)]
    first, last = sum(mean[:K]) / K, sum(mean[-K:]) / K
    assert last > first + 0.2, [round(m, 2) for m in mean]
