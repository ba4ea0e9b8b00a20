"""Checkpoint method: atomic versions, loaded bit-identical elsewhere; bad files refused."""

from __future__ import annotations

import os

import pytest
import torch
from weights_helpers import assert_bit_identical, finish, train_step

from tandem.weights import WeightPublisher, WeightSubscriber, WeightsError, load_into


def test_published_weights_arrive_bit_identical_in_another_process(
        tmp_path, tiny_model, tiny_model_dir, spawn):
    announced = []
    publisher = WeightPublisher(tmp_path, keep=3, shard_bytes=100_000, announce=announced.append)
    train_step(tiny_model, seed=1)
    published = publisher.publish(1, tiny_model.named_parameters())

    assert [p.version for p in announced] == [1]
    assert published.path == tmp_path / "weights" / "v1"
    assert published.shards > 1  # shard_bytes forces several files
    assert sorted(os.listdir(tmp_path / "weights")) == ["v1"]  # no temp folder left behind

    out = tmp_path / "out"
    out.mkdir()
    finish(spawn("checkpoint", tmp_path, out, 1))
    assert_bit_identical(tiny_model, out / "v1.safetensors")


def test_load_into_module_in_process(tmp_path, tiny_model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    train_step(tiny_model, seed=2)
    WeightPublisher(tmp_path).publish(0, tiny_model.named_parameters())
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert load_into(fresh, WeightSubscriber(tmp_path).load(0)) == len(
        list(tiny_model.named_parameters()))
    for (name, a), (_, b) in zip(tiny_model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name


def _publish_small(tmp_path, version=0, **kwargs):
    tensors = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
               ("b", torch.ones(4, dtype=torch.bfloat16)),
               ("c", torch.zeros(3, dtype=torch.int64))]
    return WeightPublisher(tmp_path, shard_bytes=2**20, **kwargs).publish(version, tensors)


def test_corrupted_shard_is_refused_naming_the_file(tmp_path):
    published = _publish_small(tmp_path)
    shard = next(published.path.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"{shard}.*corrupt"):
        WeightSubscriber(tmp_path).load(0)


def test_missing_and_truncated_shards_are_refused(tmp_path):
    published = _publish_small(tmp_path)
    shard = next(published.path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(WeightsError, match=f"{shard} has .* bytes"):
        WeightSubscriber(tmp_path, verify=False).load(0)
    shard.unlink()
    with pytest.raises(WeightsError, match=f"{shard} is missing"):
        WeightSubscriber(tmp_path).load(0)


def test_manifest_problems_are_named(tmp_path):
    published = _publish_small(tmp_path, version=4)
    subscriber = WeightSubscriber(tmp_path)
    with pytest.raises(WeightsError, match=r"version 5 not found.*published versions: \[4\]"):
        subscriber.load(5)
    (published.path / "manifest.json").write_text('{"version": "x"}')
    with pytest.raises(WeightsError, match="manifest .*manifest.json is malformed"):
        subscriber.load(4)


def test_versions_are_immutable_and_leftovers_removed(tmp_path):
    _publish_small(tmp_path)
    with pytest.raises(WeightsError, match="already exists"):
        _publish_small(tmp_path)
    (tmp_path / "weights" / ".tmp-v9-1-deadbeef").mkdir()
    (tmp_path / "weights" / "v7").mkdir()  # no manifest: a half version never counts
    assert WeightSubscriber(tmp_path).latest_version() == 0
    WeightPublisher(tmp_path)
    assert not (tmp_path / "weights" / ".tmp-v9-1-deadbeef").exists()


def test_retention_keeps_newest_and_versions_in_use(tmp_path):
    in_use = {1}
    publisher = WeightPublisher(tmp_path, keep=2, in_use=lambda: in_use)
    assert WeightSubscriber(tmp_path).latest_version() is None
    for v in range(5):
        publisher.publish(v, [("w", torch.full((3,), float(v)))])
    assert WeightSubscriber(tmp_path).versions() == [1, 3, 4]
    in_use.clear()
    assert publisher.prune() == [1]
    assert WeightSubscriber(tmp_path).versions() == [3, 4]
    loaded = dict(WeightSubscriber(tmp_path).load(4))
    assert torch.equal(loaded["w"], torch.full((3,), 4.0))


def test_tied_weights_and_empty_input_are_clear_errors(tmp_path):
    shared = torch.ones(4)
    with pytest.raises(WeightsError, match="'x' and 'y' share memory"):
        WeightPublisher(tmp_path).publish(0, [("x", shared), ("y", shared)])
    with pytest.raises(WeightsError, match="'x' is given twice"):
        WeightPublisher(tmp_path).publish(0, [("x", torch.ones(1)), ("x", torch.zeros(1))])
    with pytest.raises(WeightsError, match="no tensors"):
        WeightPublisher(tmp_path).publish(0, [])
    assert WeightSubscriber(tmp_path).versions() == []


def test_load_into_names_a_mismatch(tiny_model):
    with pytest.raises(WeightsError, match="no parameter or buffer 'nope'"):
        load_into(tiny_model, [("nope", torch.zeros(1))])
    name, param = next(iter(tiny_model.named_parameters()))
    with pytest.raises(WeightsError, match=f"{name!r} has shape"):
        load_into(tiny_model, [(name, torch.zeros(1))])
    with pytest.raises(WeightsError, match="no weights for"):
        load_into(tiny_model, [(name, param.detach().clone())])


def test_a_version_being_loaded_survives_its_deletion(tmp_path):
    publisher = WeightPublisher(tmp_path, keep=1, shard_bytes=2**20)
    publisher.publish(0, [("a", torch.arange(4.0)), ("b", torch.ones(2**19))])  # two shards
    tensors = WeightSubscriber(tmp_path).load(0)
    publisher.publish(1, [("a", torch.zeros(4)), ("b", torch.zeros(2**19))])  # prunes v0
    assert WeightSubscriber(tmp_path).versions() == [1]
    loaded = {name: t.clone() for name, t in tensors}
    assert torch.equal(loaded["a"], torch.arange(4.0))
    assert torch.equal(loaded["b"], torch.ones(2**19))
