"""The vLLM worker extension: with a stand-in worker here, with real vLLM where it is installed."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from weights_helpers import assert_bit_identical, finish, train_step

from tandem.explorer.vllm_worker import EXTENSION, TandemWeightExtension, vllm_engine_kwargs
from tandem.weights import WeightBroadcaster, WeightPublisher, engine_members


def test_extension_is_importable_by_the_name_vllm_is_given():
    module, _, name = EXTENSION.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is TandemWeightExtension
    assert vllm_engine_kwargs() == {"worker_extension_cls": EXTENSION}


def test_extension_in_a_stand_in_worker_loads_a_broadcast(tmp_path, tiny_model, spawn):
    # The worker is FakeVllmWorker (weights_peer.py): vLLM cannot run on this machine.
    # Everything the extension does past `model_runner.model.load_weights` is real.
    sender = WeightBroadcaster(timeout=30.0, bucket_bytes=100_000)
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        peer = spawn("fake-vllm", rendezvous.model_dump_json(), "explorer-0", tmp_path, 3, 30)
        train_step(tiny_model, seed=3)
        sender.broadcast(3, tiny_model.named_parameters())
        finish(peer)
    finally:
        sender.close()
    assert_bit_identical(tiny_model, tmp_path / "v3.safetensors")
    loaded = json.loads((tmp_path / "count.json").read_text())["tensors"]
    assert loaded == len(list(tiny_model.named_parameters()))


def test_extension_in_a_stand_in_worker_loads_a_checkpoint(tmp_path, tiny_model):
    from weights_peer import DictEngine, FakeVllmWorker  # stand-in for vLLM's worker

    train_step(tiny_model, seed=5)
    WeightPublisher(tmp_path).publish(2, tiny_model.named_parameters())
    engine = DictEngine()
    worker = type("Worker", (TandemWeightExtension, FakeVllmWorker), {})(engine)
    assert worker.tandem_load_checkpoint(str(tmp_path), 2) == len(engine.state)
    for name, param in tiny_model.named_parameters():
        assert torch.equal(engine.state[name], param), name
    with pytest.raises(RuntimeError, match="before tandem_join"):
        worker.tandem_receive(3)


@pytest.mark.gpu
@pytest.mark.vllm
def test_real_vllm_engine_receives_a_broadcast_and_a_checkpoint(tmp_path, tiny_model_dir):
    vllm = pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    train_step(model, seed=4)
    llm = vllm.LLM(model=str(tiny_model_dir), enforce_eager=True, gpu_memory_utilization=0.2,
                   **vllm_engine_kwargs())
    sender = WeightBroadcaster(timeout=120.0, device="cuda")
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        weights = [(n, p.detach().cuda()) for n, p in model.named_parameters()]
        sent = threading.Thread(target=sender.broadcast, args=(1, weights))
        sent.start()
        llm.collective_rpc("tandem_join", args=(rendezvous.model_dump(), "explorer-0", 120.0))
        counts = llm.collective_rpc("tandem_receive", args=(1,))
        sent.join(120)
        WeightPublisher(tmp_path).publish(1, model.named_parameters())
        loaded = llm.collective_rpc("tandem_load_checkpoint", args=(str(tmp_path), 1))
    finally:
        sender.close()
    n = len(list(model.named_parameters()))
    assert counts == [n] and loaded == [n]
