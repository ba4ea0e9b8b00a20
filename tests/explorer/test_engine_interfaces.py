"""Two engine interfaces, one per way of taking weights, each complete or not instantiable."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.explorer.engine import Engine, TensorEngine, WorkerFetchEngine
from tandem.explorer.remote_engine import RemoteEngine
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.explorer.vllm_engine import VLLMEngine
from tandem.explorer.weights import WeightLoader


class GenerateOnly(Engine):
    tokenizer = None

    async def generate(self, prompts, n, sampling):
        return []


class FetchesCheckpointsOnly(WorkerFetchEngine):
    tokenizer = None

    async def generate(self, prompts, n, sampling):
        return []

    async def fetch_checkpoint(self, run_dir: str, version: int) -> int:
        return 0


def test_each_engine_is_exactly_one_kind():
    assert issubclass(TransformersEngine, TensorEngine)
    assert not issubclass(TransformersEngine, WorkerFetchEngine)
    assert issubclass(VLLMEngine, WorkerFetchEngine)
    assert not issubclass(VLLMEngine, TensorEngine)
    assert not hasattr(VLLMEngine, "load_weights")
    # a remote server's workers reload checkpoints themselves: tensors never pass through
    assert issubclass(RemoteEngine, WorkerFetchEngine)
    assert not issubclass(RemoteEngine, TensorEngine)


def test_a_worker_fetch_engine_missing_a_method_cannot_be_built():
    with pytest.raises(TypeError, match="fetch_broadcast"):
        FetchesCheckpointsOnly()


def test_the_loader_refuses_an_engine_with_no_way_to_take_weights(tmp_path):
    engine: Any = GenerateOnly()
    with pytest.raises(TypeError, match="GenerateOnly is neither a TensorEngine nor a "
                                        "WorkerFetchEngine"):
        WeightLoader(engine, run_dir=tmp_path, explorer="explorer-0", timeout=1.0)
