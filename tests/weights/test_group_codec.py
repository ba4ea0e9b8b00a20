"""The weight group's store values are messages of the project codec, not a codec of their own."""

from __future__ import annotations

import msgpack
import pytest

from tandem.common import codec
from tandem.common.errors import ProtocolError
from tandem.common.messages.weights import BroadcastMeta, BucketSpec, GroupMember, TensorSpec
from tandem.weights.group import decode, encode


def test_a_store_value_is_one_frame_any_codec_reader_decodes():
    meta = BroadcastMeta(version=3, seq=0,
                         tensors=[TensorSpec(name="w", dtype="bfloat16", shape=[2, 3])],
                         buckets=[BucketSpec(dtype="bfloat16", numel=6, first=0, count=1)])
    raw = encode(meta, "meta/0")
    envelope = codec.decode([raw])
    assert envelope.type == "weights.broadcast.meta" and envelope.id == "meta/0"
    assert envelope.body == meta
    assert decode(raw, BroadcastMeta, "meta/0") == meta


def test_a_value_of_another_type_is_refused_naming_the_key():
    raw = encode(GroupMember(name="e/w0", rank=1, device="cpu", host="h", pid=1), "join/1")
    with pytest.raises(ProtocolError, match=r"store key meta/4: expected a 'weights.broadcast.meta'"):
        decode(raw, BroadcastMeta, "meta/4")


@pytest.mark.parametrize("raw", [b"\xc1", msgpack.packb({"type": "weights.broadcast.meta"}),
                                 msgpack.packb([1, 2])])
def test_garbage_is_a_protocol_error_naming_the_key(raw):
    with pytest.raises(ProtocolError, match=r"^store key meta/0: "):
        decode(raw, BroadcastMeta, "meta/0")


def test_a_gloo_group_times_out_in_seconds_past_the_guard():
    # the backend's own bound is the guard's plus slack, in seconds (it once read as days)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tandem.weights.group import GRACE, build_backend

    pg = build_backend("gloo", dist.HashStore(), 0, 1, device=torch.device("cpu"),
                       bind_host="127.0.0.1", timeout=3.0)
    assert pg.options._timeout == timedelta(seconds=3.0 + 2 * GRACE)
