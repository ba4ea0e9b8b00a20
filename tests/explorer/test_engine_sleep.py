"""TransformersEngine asleep (`placement.colocate`): sleep releases every parameter's storage,
generation is refused until a version is loaded, and waking to a version published in shared
memory gives exactly the completions of an engine that never slept."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandem.explorer.sampling import SamplingParams
from tandem.explorer.transformers_engine import EngineAsleep, TransformersEngine
from tandem.weights.shm import SharedMemoryPublisher, SharedMemorySubscriber

PARAMS = SamplingParams(temperature=1.0, max_tokens=8, seed=5)


def held_bytes(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def tokens(engine: TransformersEngine) -> list[list[int]]:
    return [c.token_ids.tolist() for row in engine.generate_sync(["12+3=", "ab"], 2, PARAMS)
            for c in row]


@pytest.fixture
def run_dir(tmp_path):
    """An in-process publisher starts this process's resource tracker, which would outlive the
    test (a trainer's ends with the trainer): stopped here, as in tests/weights/test_shm.py."""
    from multiprocessing import resource_tracker

    yield tmp_path / "run"
    resource_tracker._resource_tracker._stop()


def test_sleep_releases_weights_and_wakes_to_a_shared_memory_version(engine, tiny_model_path,
                                                                    run_dir):
    # version 1: the model with every weight nudged, published as the trainer would
    trained = TransformersEngine.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    expected = tokens(trained)
    publisher = SharedMemoryPublisher(run_dir)
    try:
        publisher.publish(1, trained.model.named_parameters())
        full = held_bytes(engine.model)
        before = tokens(engine)
        assert before != expected

        stats = asyncio.run(engine.sleep())
        assert stats["released_bytes"] == full
        # one element per parameter is what is left of them
        assert held_bytes(engine.model) <= sum(
            p.element_size() for p in engine.model.parameters())
        with pytest.raises(EngineAsleep, match="asleep"):
            tokens(engine)
        assert asyncio.run(engine.sleep()) == {"released_bytes": 0}  # a repeat is harmless

        assert asyncio.run(engine.wake())["allocated_bytes"] == full
        with pytest.raises(EngineAsleep, match="woken"):  # fresh memory, not yet loaded
            tokens(engine)
        subscriber = SharedMemorySubscriber(run_dir)
        asyncio.run(engine.update_weights(lambda: subscriber.load(1), 1))
        assert engine.version == 1 and engine.state == "awake"
        assert tokens(engine) == expected
        # tied parameters stay one tensor
        model = engine.model
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight is model.get_input_embeddings().weight
    finally:
        publisher.close()
        trained.close()


def test_a_load_wakes_an_engine_asleep_without_a_wake(engine, tiny_model_path):
    weights = {n: t.clone() for n, t in engine.model.named_parameters()}
    before = tokens(engine)
    engine.sleep_sync()
    engine.load_weights(weights.items(), 2)
    assert engine.state == "awake" and tokens(engine) == before
