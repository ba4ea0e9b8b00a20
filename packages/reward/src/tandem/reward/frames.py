"""Length-prefixed msgpack frames on a pipe: the scorer <-> worker process protocol."""

from __future__ import annotations

import struct

import msgpack

HEADER = struct.Struct(">I")


def pack(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> object:
    return msgpack.unpackb(body, raw=False, strict_map_key=False)
