"""New weights reach the engine by checkpoint and by broadcast, and its outputs become the
trainer's: the trainer side here is the real WeightPublisher / WeightBroadcaster."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from backstop import BACKSTOP
from tandem.weights import WeightBroadcaster, WeightPublisher, WeightsError, engine_member
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.explorer.weights import WeightLoader

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["1+2=", "hello"]


@pytest.fixture
def trained(tiny_model_path):
    """The trainer's model after an update: the base weights, perturbed."""
    eng = TransformersEngine.from_pretrained(tiny_model_path)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in eng.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    yield eng
    eng.close()


def outputs(engine):
    return [list(c.token_ids) for g in engine.generate_sync(PROMPTS, 1, GREEDY) for c in g]


def test_checkpoint_load_makes_outputs_the_trainers(engine, trained, tmp_path):
    before = outputs(engine)
    WeightPublisher(tmp_path).publish(1, trained.model.named_parameters())
    loader = WeightLoader(engine, run_dir=tmp_path, explorer="explorer-0", timeout=BACKSTOP)
    stats = asyncio.run(loader.load(1, "checkpoint"))
    assert engine.version == 1 and stats["tensors"] == len(list(trained.model.parameters()))
    assert outputs(engine) == outputs(trained) != before
    for (name, p), q in zip(engine.model.named_parameters(), trained.model.parameters()):
        assert torch.equal(p, q), name


def test_checkpoint_of_a_missing_version_is_a_clear_error(engine, tmp_path):
    loader = WeightLoader(engine, run_dir=tmp_path, explorer="explorer-0", timeout=BACKSTOP)
    with pytest.raises(WeightsError, match="version 4 not found"):
        asyncio.run(loader.load(4, "checkpoint"))
    assert engine.version == 0


def test_broadcast_load_makes_outputs_the_trainers(engine, trained):
    before = outputs(engine)
    sender = WeightBroadcaster(timeout=BACKSTOP)
    rendezvous = sender.open_group([engine_member("explorer-0")])
    errors = []

    def trainer():
        try:
            for version in (1, 2):
                sender.broadcast(version, trained.model.named_parameters())
                with torch.no_grad():  # the next version differs again
                    for p in trained.model.parameters():
                        p.mul_(0.5)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    async def explorer():
        loader = WeightLoader(engine, run_dir="unused", explorer="explorer-0", timeout=BACKSTOP)
        loader.offer_group(rendezvous)  # announced before the sync point
        got = []
        for version in (1, 2):
            await loader.load(version, "nccl", rendezvous)
            got.append(outputs(engine))
        await loader.close()
        return got

    thread = threading.Thread(target=trainer)
    expected = []
    try:
        # the trainer's model changes after each send; record what each version generates
        with torch.no_grad():
            snapshot = [p.clone() for p in trained.model.parameters()]
        expected.append(outputs(trained))
        with torch.no_grad():
            for p in trained.model.parameters():
                p.mul_(0.5)
        expected.append(outputs(trained))
        with torch.no_grad():
            for p, s in zip(trained.model.parameters(), snapshot):
                p.copy_(s)
        thread.start()
        got = asyncio.run(asyncio.wait_for(explorer(), BACKSTOP))
    finally:
        thread.join(BACKSTOP)
        sender.close()
    assert not errors, errors
    assert engine.version == 2 and got == expected and got[0] != before


def test_broadcast_without_a_group_names_the_missing_rendezvous(engine):
    loader = WeightLoader(engine, run_dir="unused", explorer="explorer-0", timeout=5)
    with pytest.raises(WeightsError, match="no weight group"):
        asyncio.run(loader.load(1, "nccl", None))


def test_a_broadcast_load_takes_the_version_from_disk_once_a_resumed_trainer_wrote_it(
        engine, trained, tmp_path):
    """nccl: a version that went by in a broadcast is never sent again; a trainer that resumed
    writes it to weights/v{N}, and an explorer already waiting for it (no group announced)
    takes it from there instead of failing."""
    loader = WeightLoader(engine, run_dir=tmp_path, explorer="explorer-0", timeout=BACKSTOP)
    looked: list[bool] = []  # what each look for weights/v3 on disk found
    on_disk = loader._on_disk

    def looking(version: int) -> bool:
        looked.append(on_disk(version))
        return looked[-1]

    loader._on_disk = looking

    async def scenario():
        waiting = asyncio.ensure_future(loader.load(3, "nccl", None))
        # it found no group and, a second time, no file: it waits for the file now
        deadline = asyncio.get_running_loop().time() + BACKSTOP
        while len(looked) < 2:
            assert asyncio.get_running_loop().time() < deadline, "the loader never looked again"
            await asyncio.sleep(0.01)
        assert not waiting.done() and not any(looked)
        await asyncio.to_thread(WeightPublisher(tmp_path).publish, 3,
                                trained.model.named_parameters())
        return await asyncio.wait_for(waiting, BACKSTOP)

    asyncio.run(scenario())
    assert engine.version == 3 and outputs(engine) == outputs(trained)


def test_a_broadcast_load_with_no_group_and_no_file_fails_within_its_timeout(engine, tmp_path):
    loader = WeightLoader(engine, run_dir=tmp_path, explorer="explorer-0", timeout=1.0)
    with pytest.raises(WeightsError, match="no weight group naming it"):
        asyncio.run(loader.load(3, "nccl", None))
    assert engine.version == 0
