"""Images in `multi_turn` episodes (docs/vision.md): a task's images reach the first turn's
prompt, every later turn still shows them, and the experience records the widened prompt and
the images' hashes, with the placeholders out of the action mask."""

from __future__ import annotations

import asyncio

import pytest
from vision_helpers import picture

from tandem.common.images import image_hash, normalise
from tandem.common.messages.experience import Task
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.workflows import RolloutContext, create_workflow

pytest.importorskip("PIL")


def test_multi_turn_episode_shows_the_task_images_on_every_turn(tiny_vlm_dir):
    from tandem.explorer.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(tiny_vlm_dir)
    try:
        # the random model never writes a valid guess: three model turns, two replies between
        wf = create_workflow("multi_turn", engine.tokenizer, {
            "env": "guess_number", "max_turns": 3, "max_episode_tokens": 400})
        red, blue = normalise(picture((255, 0, 0))), normalise(picture((0, 0, 255)))
        tasks = [Task(id="g0", payload={"secret": 7, "low": 1, "high": 10,
                                        "images": [red, blue]}),
                 Task(id="g1", payload={"seed": 3})]
        ctx = RolloutContext(engine=engine, sampling=SamplingParams(max_tokens=6, seed=1),
                             repeat_times=2, explorer="explorer-0", run="run1")
        exps = asyncio.run(wf.run(tasks, ctx))
    finally:
        engine.close()
    pad = engine.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    shown = [e for e in exps if e.task_id == "g0"]
    assert len(shown) == 2
    for e in shown:
        assert e.images == [image_hash(red), image_hash(blue)]
        assert e.info["turns"] == 3, e.info
        tokens = e.tokens.tolist()
        assert tokens[:e.prompt_len].count(pad) == 2 * 16  # both widened, 16 each at 64 x 64
        assert pad not in tokens[e.prompt_len:]  # later turns added no placeholders
    for e in exps:
        if e.task_id == "g1":
            assert e.images == [] and pad not in e.tokens.tolist()
