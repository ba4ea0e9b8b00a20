"""Length-prefixed msgpack frames on a pipe, and unframed messages on a SEQPACKET socket: the
scorer <-> template and worker process protocols (`worker`)."""

from __future__ import annotations

import struct

import msgpack

HEADER = struct.Struct(">I")


def encode(obj: object) -> bytes:
    """One msgpack message, unframed (a SEQPACKET socket keeps the boundaries)."""
    return msgpack.packb(obj, use_bin_type=True)


def pack(obj: object) -> bytes:
    body = encode(obj)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> object:
    return msgpack.unpackb(body, raw=False, strict_map_key=False)
