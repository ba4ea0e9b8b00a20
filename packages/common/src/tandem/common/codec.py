"""MessagePack codec: a message is frame 0 (a msgpack map) plus one raw frame per large array.

Frame 0 holds the envelope (`v`, `type`, `id`, and `ok`/`error`/`result` for replies, `body`
for requests and events) and every small field. An array at or above `inline_threshold`
bytes is replaced in frame 0 by `{"__nd__": [dtype, shape, k]}` and sent as raw frame k,
zero-copy; a smaller one travels inline as `{"__nd__": [dtype, shape, bytes]}`. Any msgpack
reader can read frame 0. Decoding validates the envelope, every array reference (dtype
known, bytes == prod(shape) * itemsize, each frame used exactly once) and the body against
the message's schema; whatever goes wrong raises one `ProtocolError` saying what and where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from .errors import ProtocolError
from .messages.base import PROTOCOL_VERSION, REGISTRY, ErrorInfo, Message

ND = "__nd__"
DEFAULT_INLINE_THRESHOLD = 16384
DEFAULT_MAX_MESSAGE_BYTES = 2**31

_NUMPY_DTYPES = {
    name: np.dtype(name)
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64")
}
_NAME_OF = {dtype: name for name, dtype in _NUMPY_DTYPES.items()}  # dtype.name is slow
DTYPES = frozenset(_NUMPY_DTYPES) | {"bfloat16"}

Frame = Any  # bytes, memoryview, or a zmq.Frame


@dataclass(slots=True)
class Envelope:
    """A decoded message: `body` for requests and events, `ok` + `body`/`error` for replies."""

    type: str
    id: str
    body: Message | None = None
    ok: bool | None = None
    error: ErrorInfo | None = None
    ttl: float | None = None
    seq: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _torch():
    import torch

    return torch


def _as_numpy(value: Any) -> tuple[str, np.ndarray]:
    """(wire dtype name, a C-contiguous numpy view) of an ndarray or torch tensor."""
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            value = np.ascontiguousarray(value)
        name = _NAME_OF.get(value.dtype)
        if name is None:
            raise ProtocolError(f"arrays of dtype {value.dtype} cannot be sent")
        return name, value
    torch = _torch()
    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return "bfloat16", tensor.view(torch.int16).numpy()
    array = tensor.numpy()
    name = _NAME_OF.get(array.dtype)
    if name is None:
        raise ProtocolError(f"tensors of dtype {tensor.dtype} cannot be sent")
    return name, array


class _Packer:
    __slots__ = ("frames", "threshold", "_packer")

    def __init__(self, threshold: int):
        self.frames: list[Frame] = []
        self.threshold = threshold
        self._packer = msgpack.Packer(default=self._default, use_bin_type=True)

    def _default(self, value: Any) -> Any:
        if isinstance(value, BaseModel):
            # The model's own field dict, packed in C: no intermediate copy of the message.
            return value.__dict__
        if isinstance(value, np.ndarray) or (
            type(value).__module__.startswith("torch") and hasattr(value, "dtype")
        ):
            name, array = _as_numpy(value)
            shape = list(array.shape)
            data = memoryview(array).cast("B") if array.nbytes else b""
            if array.nbytes >= self.threshold:
                self.frames.append(data)
                return {ND: [name, shape, len(self.frames)]}
            return {ND: [name, shape, data]}  # msgpack copies it once, into frame 0
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, (set, frozenset, tuple)):
            return list(value)
        raise TypeError(f"cannot encode {type(value).__name__}")

    def pack(self, header: dict[str, Any]) -> list[Frame]:
        try:
            head = self._packer.pack(header)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ProtocolError(f"cannot encode message {header.get('type')!r}: {exc}") from None
        return [head, *self.frames]


def _dump(body: Message) -> Any:
    return body  # packed through _Packer._default, field by field


def encode_request(body: Message, id: str, *, ttl: float | None = None,
                   inline_threshold: int = DEFAULT_INLINE_THRESHOLD) -> list[Frame]:
    """Frames of a request (or a one-way message) with id `id` and a time-to-live in seconds."""
    header = {"v": PROTOCOL_VERSION, "type": body.TYPE, "id": id, "body": _dump(body)}
    if ttl is not None:
        header["ttl"] = ttl
    return _Packer(inline_threshold).pack(header)


def encode_event(body: Message, id: str, seq: int, *,
                 inline_threshold: int = DEFAULT_INLINE_THRESHOLD) -> list[Frame]:
    """Frames of a published event with its per-topic sequence number."""
    header = {"v": PROTOCOL_VERSION, "type": body.TYPE, "id": id, "seq": seq, "body": _dump(body)}
    return _Packer(inline_threshold).pack(header)


def encode_reply(id: str, result: Message | None = None, error: ErrorInfo | None = None, *,
                 inline_threshold: int = DEFAULT_INLINE_THRESHOLD) -> list[Frame]:
    """Frames of a reply: ok with `result`, or not ok with `error`."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": "reply", "id": id}
    if error is not None:
        header["ok"] = False
        header["error"] = error.model_dump()
    else:
        header["ok"] = True
        header["result_type"] = result.TYPE if result is not None else "ok"
        header["result"] = _dump(result) if result is not None else {}
    return _Packer(inline_threshold).pack(header)


def _buffer(frame: Frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return buf if buf is not None else memoryview(frame)


class _Unpacker:
    __slots__ = ("frames", "used", "where")

    def __init__(self, frames: Sequence[Frame]):
        self.frames = frames
        self.used: set[int] = set()
        self.where = "frame 0"

    def hook(self, obj: dict) -> Any:
        if len(obj) != 1 or ND not in obj:
            return obj
        ref = obj[ND]
        try:
            dtype, shape, data = ref
            np_dtype = _NUMPY_DTYPES.get(dtype)
            itemsize = np_dtype.itemsize if np_dtype is not None else (2 if dtype == "bfloat16" else 0)
            count = 1
            for dim in shape:
                if dim.__class__ is not int or dim < 0:
                    raise TypeError
                count *= dim
        except (TypeError, ValueError, AttributeError):
            raise ProtocolError(f"{self.where}: malformed array reference {ref!r:.80}") from None
        if not itemsize:
            raise ProtocolError(f"{self.where}: unknown dtype {dtype!r}")
        if data.__class__ is bytes:
            buf = memoryview(data)
            origin = "inline bytes"
        elif data.__class__ is int:
            if not 1 <= data < len(self.frames):
                raise ProtocolError(
                    f"{self.where}: array refers to frame {data}, message has {len(self.frames)} frames")
            if data in self.used:
                raise ProtocolError(f"{self.where}: frame {data} referenced twice")
            self.used.add(data)
            buf = _buffer(self.frames[data])
            origin = f"frame {data}"
        else:
            raise ProtocolError(f"{self.where}: array data must be a frame index or bytes")
        if buf.nbytes != count * itemsize:
            raise ProtocolError(
                f"{self.where}: {dtype}{tuple(shape)} needs {count * itemsize} bytes, "
                f"{origin} has {buf.nbytes}")
        if np_dtype is None:  # bfloat16: numpy has no such dtype, torch does
            torch = _torch()
            raw = np.frombuffer(buf, dtype=np.int16).reshape(shape)
            if not raw.flags.writeable:
                raw = raw.copy()
            return torch.from_numpy(raw).view(torch.bfloat16)
        return np.frombuffer(buf, dtype=np_dtype).reshape(shape)


def _check_size(frames: Sequence[Frame], max_bytes: int) -> None:
    total = sum(_buffer(f).nbytes for f in frames)
    if total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes "
                            "(transport.max_message_bytes)")


def decode_header(frames: Sequence[Frame], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
                  ) -> tuple[dict[str, Any], _Unpacker]:
    """Unpack frame 0 with arrays resolved; checks version, id, type and frame use."""
    if not frames:
        raise ProtocolError("empty message: no frames")
    _check_size(frames, max_message_bytes)
    unpacker = _Unpacker(frames)
    head = _buffer(frames[0])
    try:
        header = msgpack.unpackb(
            head, object_hook=unpacker.hook, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types on garbage; all mean the same thing
        raise ProtocolError(f"frame 0 is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"frame 0 must be a map, got {type(header).__name__}")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}")
    for key in ("type", "id"):
        if not isinstance(header.get(key), str):
            raise ProtocolError(f"frame 0: field {key!r} missing or not a string")
    unused = set(range(1, len(frames))) - unpacker.used
    if unused:
        raise ProtocolError(
            f"{header['type']}: {len(frames)} frames but frames {sorted(unused)} are not referenced")
    return header, unpacker


def validate_body(type_name: str, body: Any, cls: type[Message] | None = None) -> Message:
    """Validate a decoded body as message `type_name` (or as `cls`)."""
    if cls is None:
        cls = REGISTRY.get(type_name)
        if cls is None:
            raise ProtocolError(f"unknown message type {type_name!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"{type_name}: body must be a map, got {type(body).__name__}")
    try:
        return cls.model_validate(body, context={"wire": True})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()[:5])
        more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
        raise ProtocolError(f"{type_name}: {problems}{more}") from None
    except Exception as exc:
        raise ProtocolError(f"{type_name}: {type(exc).__name__}: {exc}") from None


def envelope_from_header(header: dict[str, Any], *, reply_type: type[Message] | None = None
                         ) -> Envelope:
    """Validate a decoded header's body (or a reply's result/error) into an Envelope."""
    type_name, id_ = header["type"], header["id"]
    if type_name == "reply":
        ok = header.get("ok")
        if ok is False:
            try:
                error = ErrorInfo.model_validate(header.get("error"))
            except ValidationError:
                raise ProtocolError(f"reply {id_}: malformed error {header.get('error')!r:.120}") from None
            return Envelope(type_name, id_, ok=False, error=error)
        if ok is not True:
            raise ProtocolError(f"reply {id_}: field 'ok' missing or not a boolean")
        result_type = header.get("result_type")
        if reply_type is not None and result_type != reply_type.TYPE:
            raise ProtocolError(
                f"reply {id_}: expected a {reply_type.TYPE!r} result, got {result_type!r}")
        body = validate_body(result_type if isinstance(result_type, str) else "",
                             header.get("result"), reply_type)
        return Envelope(type_name, id_, body=body, ok=True)
    if "body" not in header:
        raise ProtocolError(f"{type_name} {id_}: field 'body' missing")
    ttl = header.get("ttl")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
        raise ProtocolError(f"{type_name} {id_}: ttl must be a number")
    seq = header.get("seq")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int)):
        raise ProtocolError(f"{type_name} {id_}: seq must be an integer")
    body = validate_body(type_name, header["body"])
    return Envelope(type_name, id_, body=body, ttl=ttl, seq=seq)


def decode(frames: Sequence[Frame], *, reply_type: type[Message] | None = None,
           max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Decode a request, event or reply. For replies, `reply_type` validates the result."""
    try:
        header, _ = decode_header(frames, max_message_bytes=max_message_bytes)
        return envelope_from_header(header, reply_type=reply_type)
    except ProtocolError:
        raise
    except Exception as exc:  # the decoder's promise: nothing but ProtocolError escapes
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from None


def peek_id(frames: Sequence[Frame]) -> str | None:
    """Best effort: the `id` of a message that failed to decode, so the error can be answered."""
    try:
        header = msgpack.unpackb(_buffer(frames[0]), raw=False, strict_map_key=False)
        value = header.get("id") if isinstance(header, dict) else None
        return value if isinstance(value, str) else None
    except Exception:
        return None
