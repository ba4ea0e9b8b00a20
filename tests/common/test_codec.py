"""Codec: round trips of every dtype and message, and malformed input always a ProtocolError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tandem.common import codec
from tandem.common.errors import ProtocolError
from tandem.common.messages import (
    Experience, Ok, PutExperiences, SampleGroups, SnapshotEntry, SnapshotReply, experience_id,
)


def make_experience(n: int, prompt_len: int, seed: int = 0) -> Experience:
    rng = np.random.default_rng(seed)
    return Experience(
        id=experience_id("t", seed, 0, "run"), task_id="t", group_id="t@v0",
        tokens=rng.integers(0, 1000, n, dtype=np.int32), prompt_len=prompt_len,
        action_mask=np.ones(n - prompt_len, np.uint8),
        logprobs=rng.standard_normal(n - prompt_len).astype(np.float32),
        reward=1.5, rewards={"correct": 1.0, "format": 0.5}, policy_version=3, explorer="e0",
        info={"group_size": 4, "nested": {"a": [1, 2.5, "x"]}})


def assert_same_experience(a: Experience, b: Experience) -> None:
    for name in ("tokens", "action_mask", "logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y)
    for name in ("id", "task_id", "group_id", "prompt_len", "reward", "rewards",
                 "policy_version", "explorer", "created_at", "info"):
        assert getattr(a, name) == getattr(b, name)


@pytest.mark.parametrize("n", [8, 1024, 32768])
def test_experience_round_trip_inline_and_out_of_band(n):
    exps = [make_experience(n, n // 4, seed) for seed in range(3)]
    frames = codec.encode_request(PutExperiences(experiences=exps), "req-1", ttl=2.5)
    # Small arrays ride inline in frame 0; large ones get frames of their own.
    assert (len(frames) > 1) == (n * 4 >= codec.DEFAULT_INLINE_THRESHOLD)
    env = codec.decode([bytes(f) for f in frames])
    assert env.type == "buffer.put" and env.id == "req-1" and env.ttl == 2.5
    for a, b in zip(exps, env.body.experiences):
        assert_same_experience(a, b)


def test_large_arrays_are_not_copied_on_encode():
    exp = make_experience(32768, 100)
    frames = codec.encode_request(PutExperiences(experiences=[exp]), "x")
    views = [f for f in frames[1:] if isinstance(f, memoryview)]
    assert any(np.shares_memory(np.frombuffer(v, np.uint8), exp.tokens) for v in views)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(
    dtype=st.sampled_from(["bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                           "uint32", "uint64", "float16", "float32", "float64"]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)),
    st.integers(0, 4096))
def test_any_numpy_array_round_trips(array, threshold):
    msg = SnapshotReply(entries=[SnapshotEntry(topic="t", seq=1, type="x", body={"a": array})])
    frames = codec.encode_reply("id", msg, inline_threshold=threshold)
    out = codec.decode(frames, reply_type=SnapshotReply).body.entries[0].body["a"]
    assert out.dtype == array.dtype and out.shape == array.shape
    assert np.array_equal(out, array, equal_nan=array.dtype.kind == "f")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.float16])
def test_torch_tensors_round_trip_including_bfloat16(dtype):
    tensor = (torch.arange(24, dtype=torch.float32) / 7).reshape(2, 3, 4).to(dtype)
    msg = SnapshotReply(entries=[SnapshotEntry(topic="t", seq=1, type="x", body={"w": tensor})])
    out = codec.decode(codec.encode_reply("id", msg, inline_threshold=0),
                       reply_type=SnapshotReply).body.entries[0].body["w"]
    out = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
    assert out.dtype == dtype and torch.equal(out, tensor)


def test_reply_error_round_trip():
    from tandem.common.messages import ErrorInfo

    env = codec.decode(codec.encode_reply("r", error=ErrorInfo(code="full", message="m", retry_after=0.2)))
    assert env.ok is False and env.error.code == "full" and env.error.retry_after == 0.2


def _good_frames(n: int = 32768) -> list[bytes]:
    return [bytes(f) for f in codec.encode_request(
        PutExperiences(experiences=[make_experience(n, 10)]), "req")]


def _header(frames):
    return msgpack.unpackb(frames[0], raw=False)


@pytest.mark.parametrize("mutate, expect", [
    (lambda f: f[:1], "refers to frame 1, message has 1 frames"),
    (lambda f: f + [b"extra"], "not referenced"),
    (lambda f: [f[0][:-7]] + f[1:], "not valid msgpack"),
    (lambda f: [f[0], f[1][:-4]] + f[2:], "needs .* bytes"),
    (lambda f: [b"\x92\x01\x02"] + f[1:], "must be a map"),
    (lambda f: [], "no frames"),
])
def test_malformed_frames_raise_protocol_error(mutate, expect):
    with pytest.raises(ProtocolError, match=expect):
        codec.decode(mutate(_good_frames()))


def _repack(mutator):
    frames = _good_frames(64)
    header = _header(frames)
    mutator(header)
    return [msgpack.packb(header, use_bin_type=True)] + frames[1:]


@pytest.mark.parametrize("mutator, expect", [
    (lambda h: h.update(type="no.such"), "unknown message type 'no.such'"),
    (lambda h: h.update(v=99), "protocol version 99"),
    (lambda h: h.pop("id"), "'id' missing"),
    (lambda h: h.pop("body"), "'body' missing"),
    (lambda h: h["body"]["experiences"][0].pop("task_id"), r"experiences.0.task_id: Field required"),
    (lambda h: h["body"]["experiences"][0]["tokens"]["__nd__"].__setitem__(0, "int64"),
     "needs .* bytes|expected dtype int32"),
    (lambda h: h["body"]["experiences"][0]["tokens"]["__nd__"].__setitem__(0, "complex64"),
     "unknown dtype"),
    (lambda h: h["body"]["experiences"][0].__setitem__("prompt_len", 10_000), "exceeds"),
    (lambda h: h["body"].__setitem__("surprise", 1), "Extra inputs"),
])
def test_schema_violations_raise_protocol_error(mutator, expect):
    with pytest.raises(ProtocolError, match=expect):
        codec.decode(_repack(mutator))


def test_wrong_dtype_from_the_wire_is_refused_not_cast():
    def to_int64(h):
        ref = h["body"]["experiences"][0]["tokens"]["__nd__"]
        data = np.frombuffer(ref[2], np.int32).astype(np.int64)
        ref[0], ref[2] = "int64", data.tobytes()

    with pytest.raises(ProtocolError, match="expected dtype int32, got int64"):
        codec.decode(_repack(to_int64))


def test_oversized_message_is_refused():
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.decode(_good_frames(), max_message_bytes=1000)


def test_reply_of_the_wrong_type_is_refused():
    with pytest.raises(ProtocolError, match="expected a 'buffer.sample.reply' result"):
        codec.decode(codec.encode_reply("x", Ok()), reply_type=SampleGroups.REPLY)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_bytes_only_ever_raise_protocol_error(frames):
    try:
        codec.decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupting_a_valid_message_only_ever_raises_protocol_error(data):
    frames = _good_frames(64 if data.draw(st.booleans()) else 8192)
    index = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[index])
    if raw:
        for _ in range(data.draw(st.integers(1, 8))):
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    frames[index] = bytes(raw[:cut])
    try:
        codec.decode(frames)
    except ProtocolError:
        pass
