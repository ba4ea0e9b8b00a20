"""The vision quickstart's task (tandem.master.vision_task) and its SFT plumbing
(tandem.master.vision_quickstart): deterministic images a taskset loads, counts the `vision`
reward grades, and a warm start and bare greedy evaluation that run on the tiny VLM."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("PIL")


def _scene_count(path) -> int:
    """Circles counted from the pixels: connected non-white blobs (no squares are drawn)."""
    import numpy as np
    from PIL import Image

    ink = np.asarray(Image.open(path).convert("RGB")).min(axis=-1) < 250
    seen = np.zeros_like(ink)
    blobs = 0
    for y, x in zip(*np.nonzero(ink)):
        if seen[y, x]:
            continue
        blobs += 1
        stack = [(y, x)]
        while stack:
            j, i = stack.pop()
            if 0 <= j < ink.shape[0] and 0 <= i < ink.shape[1] and ink[j, i] and not seen[j, i]:
                seen[j, i] = True
                stack += [(j + 1, i), (j - 1, i), (j, i + 1), (j, i - 1)]
    return blobs


def test_taskset_is_deterministic_and_counts_are_right(tmp_path):
    from tandem.master.vision_task import write_taskset

    a_train, a_held = write_taskset(tmp_path / "a", seed=3, train=12, heldout=4)
    b_train, _ = write_taskset(tmp_path / "b", seed=3, train=12, heldout=4)
    assert a_train.read_text() == b_train.read_text()
    rows = [json.loads(line) for line in a_train.read_text().splitlines()]
    for row in rows:
        image = row["messages"][0]["content"][0]["image"]
        assert not image.startswith("/")
        assert (tmp_path / "a" / image).read_bytes() == (tmp_path / "b" / image).read_bytes()
        assert _scene_count(tmp_path / "a" / image) == row["truth"]["count"] == int(row["answer"])
    held = [json.loads(line)["messages"][0]["content"][0]["image"]
            for line in a_held.read_text().splitlines()]
    assert not set(held) & {r["messages"][0]["content"][0]["image"] for r in rows}


def test_distractor_squares_do_not_count(tmp_path):
    import random

    from tandem.master.vision_task import scene

    shapes = scene(random.Random(0), size=64, circles=2, distractors=2)
    assert sorted(s.kind for s in shapes) == ["circle", "circle", "square", "square"]


def test_the_taskset_loads_with_its_images_and_the_vision_reward_grades_it(tmp_path):
    from tandem.common.messages.reward import ScoreItem
    from tandem.common.tasks import load_tasks
    from tandem.master.vision_task import write_taskset
    from tandem.common.config.reward import RewardConfig
    from tandem.reward.functions.vision import VisionReward

    train, _ = write_taskset(tmp_path, seed=0, train=5, heldout=1)
    tasks = load_tasks(str(train))
    assert len(tasks) == 5
    assert all(len(t["images"]) == 1 and t["images"][0][:8] == b"\x89PNG\r\n\x1a\n" for t in tasks)
    grader = VisionReward(RewardConfig())
    for task in tasks:
        right = grader.score(ScoreItem(response=task["answer"], truth=task["truth"]))
        wrong = grader.score(ScoreItem(response=str(int(task["answer"]) % 4 + 1),
                                       truth=task["truth"]))
        assert (right.score, wrong.score) == (1.0, 0.0)


def test_warm_start_and_greedy_answers_run_on_the_tiny_vlm(tiny_vlm_dir, tmp_path):
    from tandem.master.vision_quickstart import greedy_answers, warm_start_vlm
    from tandem.master.vision_task import write_taskset

    train, heldout = write_taskset(tmp_path / "data", seed=0, train=8, heldout=3)
    loss = warm_start_vlm(tiny_vlm_dir, tmp_path / "sft", train, steps=2, batch=4)
    assert math.isfinite(loss)
    answers = greedy_answers(tmp_path / "sft", heldout, max_new_tokens=2)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)


def test_the_vision_quickstart_run_grades_counts_with_the_vision_reward(tmp_path):
    from tandem.master.quickstart import quickstart_config
    from tandem.master.vision_task import write_taskset

    train, heldout = write_taskset(tmp_path / "data", seed=0, train=2, heldout=1)
    config = quickstart_config(tmp_path / "run", tmp_path / "model", train, preset="synchronous",
                               steps=3, seed=0, heldout=heldout, reward_fn="vision",
                               max_tokens=3)
    explorer = config.explorers[0]
    assert config.reward.functions == {"vision": 1.0}
    assert explorer.workflow_args["reward_fn"] == "vision" and explorer.sampling.max_tokens == 3
    assert [t.path for t in config.eval.tasksets] == [str(heldout)]


def test_colour_tasks_take_turns_and_show_their_colour(tmp_path):
    import numpy as np
    from PIL import Image

    from tandem.master.vision_task import COLOURS, colour_tasks

    rows = colour_tasks(tmp_path, "train", 9, seed=0)
    assert [r["answer"] for r in rows] == list("ABC" * 3)  # any 3 in a row: each colour once
    assert colour_tasks(tmp_path / "again", "train", 9, seed=0) == rows
    for row in rows:
        pixels = np.asarray(Image.open(tmp_path / row["messages"][0]["content"][0]["image"]))
        assert pixels.shape == (32, 32, 3) and (pixels == pixels[0, 0]).all()
        nearest = min(COLOURS, key=lambda k: np.abs(pixels[0, 0] - COLOURS[k]).sum())
        assert nearest == row["answer"] == row["truth"]["answer"]
