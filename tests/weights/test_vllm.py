"""The vLLM worker extension: with a stand-in worker here, with real vLLM where it is installed
(tests marked `vllm`: `make test-vllm`; the gloo broadcast runs on CPU, the NCCL one needs CUDA)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from backstop import BACKSTOP
from processes import vllm_processes
from weights_helpers import assert_bit_identical, finish, train_step

from tandem.explorer.sampling import SamplingParams, policy_logprobs
from tandem.explorer.vllm_worker import EXTENSION, TandemWeightExtension, vllm_engine_kwargs
from tandem.weights import WeightBroadcaster, WeightPublisher, engine_members


def test_extension_is_importable_by_the_name_vllm_is_given():
    module, _, name = EXTENSION.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is TandemWeightExtension
    assert vllm_engine_kwargs() == {"worker_extension_cls": EXTENSION}


def test_extension_in_a_stand_in_worker_loads_a_broadcast(tmp_path, tiny_model, spawn):
    # The worker is FakeVllmWorker (weights_peer.py): vLLM cannot run on this machine.
    # Everything the extension does past `model_runner.model.load_weights` is real.
    sender = WeightBroadcaster(timeout=BACKSTOP, bucket_bytes=100_000)
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        peer = spawn("fake-vllm", rendezvous.model_dump_json(), "explorer-0", tmp_path, 3,
                     BACKSTOP)
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
    sender = WeightBroadcaster(timeout=BACKSTOP, device="cuda")
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        weights = [(n, p.detach().cuda()) for n, p in model.named_parameters()]
        sent = threading.Thread(target=sender.broadcast, args=(1, weights))
        sent.start()
        llm.collective_rpc("tandem_join", args=(rendezvous.model_dump(), "explorer-0", BACKSTOP))
        counts = llm.collective_rpc("tandem_receive", args=(1,))
        sent.join(BACKSTOP)
        WeightPublisher(tmp_path).publish(1, model.named_parameters())
        loaded = llm.collective_rpc("tandem_load_checkpoint", args=(str(tmp_path), 1))
    finally:
        sender.close()
    n = len(list(model.named_parameters()))
    assert counts == [n] and loaded == [n]


def teacher_forced_gap(model, groups, params) -> float:
    """The worst |engine - trainer| logprob of the sampled tokens, the trainer's forward run on
    prompt + response under the same sampling policy."""
    worst = 0.0
    for c in (c for group in groups for c in group):
        assert len(c.token_ids) == len(c.logprobs) > 0
        ids = torch.tensor(list(c.prompt_ids) + list(c.token_ids))[None]
        with torch.no_grad():
            logits = model(ids).logits[0]
        p = len(c.prompt_ids)
        want = policy_logprobs(logits[p - 1:-1], params).gather(-1, ids[0, p:, None]).squeeze(-1)
        worst = max(worst, (want - torch.from_numpy(c.logprobs)).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def cpu_vllm(tmp_path_factory):
    """A tiny Qwen2 (hidden 128 over 2 heads: vLLM's CPU attention needs head_dim >= 32) and a
    real `VLLMEngine` on it, started once for the module (a minute or more on CPU)."""
    pytest.importorskip("vllm")
    from tandem.explorer.vllm_engine import VLLMEngine
    from tandem.weights.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("vllm-cpu-model")
    model, _ = build_tiny_model(path, hidden=128, heads=2, kv_heads=1)
    engine = VLLMEngine.from_pretrained(path, dtype="float32", max_model_len=64,
                                        enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    yield model, engine
    engine.close()
    assert vllm_processes() == []


@pytest.mark.vllm
async def test_real_vllm_on_cpu_takes_gloo_broadcasts_into_its_workers(cpu_vllm, tmp_path):
    """The explorer's path (`WeightLoader` -> `join_group` / `fetch_broadcast` -> the worker
    extension in vLLM's own worker process) fed by a trainer-side broadcaster over gloo: after
    each load the engine samples the trainer's new weights."""
    from tandem.explorer.weights import WeightLoader

    model, engine = cpu_vllm
    prompts = ["1+2=", "The quick brown fox"]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    n = len(list(model.named_parameters()))
    sender = WeightBroadcaster(backend="gloo", timeout=BACKSTOP)
    loader = WeightLoader(engine, run_dir=tmp_path / "run", explorer="explorer-0",
                          timeout=BACKSTOP)
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        # the explorer joins as soon as the group is announced, long before the trainer's first
        # broadcast; the engine must go on generating meanwhile
        loader.offer_group(rendezvous)
        for version in (1, 2):
            before = await asyncio.wait_for(engine.generate(prompts, 2, params), BACKSTOP)
            train_step(model, seed=version)
            sent = asyncio.to_thread(sender.broadcast, version, list(model.named_parameters()))
            stats, broadcast = await asyncio.wait_for(asyncio.gather(
                loader.load(version, "nccl", rendezvous), sent), BACKSTOP)
            assert broadcast.backend == "gloo" and broadcast.epoch == 1
            assert engine.version == version and stats["tensors"] == n
            model.eval()
            after = await engine.generate(prompts, 2, params)
            # the new weights' logprobs (the contract's vLLM tolerance, float32 on CPU), and
            # not the old ones': the same seeded call gave other logprobs before the load
            assert teacher_forced_gap(model, after, params) < 2e-3
            assert teacher_forced_gap(model, before, params) > 1e-2
            model.train()
    finally:
        await loader.close()
        sender.close()
