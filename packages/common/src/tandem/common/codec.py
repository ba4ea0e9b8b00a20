"""MessagePack codec: a message is frame 0 (a msgpack map) plus one raw frame per large array.

Frame 0 holds the envelope (`v`, `type`, `id`, and `ok`/`error`/`result` for replies, `body`
for requests and events) and every small field. An array at or above `inline_threshold`
bytes is replaced in frame 0 by `{"__nd__": [dtype, shape, k]}` and sent as raw frame k,
zero-copy; a smaller one travels inline as `{"__nd__": [dtype, shape, bytes]}`. Any msgpack
reader can read frame 0. Decoding validates the envelope, every array reference (dtype
known, bytes == prod(shape) * itemsize, each frame used exactly once) and the body against
the message's schema; whatever goes wrong raises one `ProtocolError` saying what and where.

What a peer can make a receiver allocate is bounded before anything is built (`Limits`): the
frame count, the message bytes, the items of any one msgpack container and of the string and
bin values (msgpack's own unpacker limits, so a lying header allocates nothing), the items of
the list fields a message type declares bounded (`Message.LIMITS`, read from the raw array
header), and the nesting depth (checked on the msgpack tree, before schema validation builds
any object). A breach raises `LimitExceeded`.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from .errors import ProtocolError
from .messages.base import PROTOCOL_VERSION, REGISTRY, ErrorInfo, Message

ND = "__nd__"
DEFAULT_INLINE_THRESHOLD = 16384
DEFAULT_MAX_MESSAGE_BYTES = 2**31
DEFAULT_MAX_FRAMES = 16384
DEFAULT_MAX_ITEMS = 65536
DEFAULT_MAX_DEPTH = 32
MAX_NDIM = 32

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxdict = 4
_short.maxlevel = 2


class LimitExceeded(ProtocolError):
    """A message is larger than a configured limit allows; it was refused before decoding."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one received message may make a component allocate.

    `items` bounds list fields of the message body per type: `{type: {field: (max, key)}}`,
    where `key` is the config key that raises the limit (see `Message.LIMITS`).
    """

    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_frames: int = DEFAULT_MAX_FRAMES
    max_items: int = DEFAULT_MAX_ITEMS
    max_depth: int = DEFAULT_MAX_DEPTH
    items: Mapping[str, Mapping[str, tuple[int, str]]] = field(default_factory=dict)

    @classmethod
    def of(cls, transport: Any, items: Mapping[str, Mapping[str, tuple[int, str]]] | None = None
           ) -> Limits:
        """The limits of a `TransportConfig` (plus per-type item limits)."""
        return cls(max_bytes=transport.max_message_bytes, max_frames=transport.max_frames,
                   max_items=transport.max_items, max_depth=transport.max_depth,
                   items=dict(items or {}))


DEFAULT_LIMITS = Limits()

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
    __slots__ = ("_packer", "frames", "threshold")

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
            if len(shape) > MAX_NDIM:
                raise TypeError
            np_dtype = _NUMPY_DTYPES.get(dtype)
            itemsize = np_dtype.itemsize if np_dtype is not None else (2 if dtype == "bfloat16" else 0)
            count = 1
            for dim in shape:
                if dim.__class__ is not int or dim < 0:
                    raise TypeError
                count *= dim
        except (TypeError, ValueError, AttributeError):
            raise ProtocolError(
                f"{self.where}: malformed array reference {_short.repr(ref)}") from None
        if not itemsize:
            raise ProtocolError(f"{self.where}: unknown dtype {_short.repr(dtype)}")
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


def _check_size(frames: Sequence[Frame], limits: Limits) -> None:
    if len(frames) > limits.max_frames:
        raise LimitExceeded(f"message of {len(frames)} frames exceeds the limit of "
                            f"{limits.max_frames} frames (transport.max_frames)")
    total = sum(_buffer(f).nbytes for f in frames)
    if total > limits.max_bytes:
        raise LimitExceeded(f"message of {total} bytes exceeds the limit of {limits.max_bytes} "
                            "bytes (transport.max_message_bytes)")


class _Reader:
    """A file-like view of a frame for msgpack's streaming Unpacker, which then holds only
    `read_size` bytes at a time instead of a copy of the whole frame."""

    __slots__ = ("pos", "view")

    def __init__(self, view: memoryview, pos: int = 0):
        self.view, self.pos = view, pos

    def read(self, n: int) -> bytes:
        chunk = bytes(self.view[self.pos:self.pos + n])
        self.pos += len(chunk)
        return chunk


def _raw_unpacker(head: memoryview, limits: Limits, start: int = 0) -> msgpack.Unpacker:
    return msgpack.Unpacker(
        _Reader(head, start), read_size=4096, raw=False, strict_map_key=False,
        max_buffer_size=max(min(len(head) - start, limits.max_bytes), 4096),
        max_array_len=limits.max_items, max_map_len=limits.max_items, max_ext_len=0)


def _check_items(head: memoryview, limits: Limits) -> None:
    """Compare the raw array headers of a type's bounded body fields with their limits.

    Reads the top-level keys, the type and the body's keys, and skips other values in C. A body
    sent before its type is held to the strictest limit of any type with that field. Garbage
    is left for the full decode to report.
    """
    try:
        up = _raw_unpacker(head, limits)
        type_name = body_at = None
        for _ in range(up.read_map_header()):
            key = up.unpack()
            if key == "type":
                type_name = up.unpack()
                if body_at is None:
                    continue
            elif key == "body" and body_at is None:
                body_at = up.tell()
                if type_name is None:
                    break
            else:
                up.skip()
                continue
            break
        if body_at is None:
            return
        if type_name is None:
            bounded: dict[str, tuple[int, str]] = {}
            for fields in limits.items.values():
                for name, limit in fields.items():
                    bounded[name] = min(bounded.get(name, limit), limit)
            type_name = "body"
        else:
            bounded = limits.items.get(type_name) if isinstance(type_name, str) else None
        if not bounded:
            return
        up = _raw_unpacker(head, limits, body_at)
        for _ in range(up.read_map_header()):
            key = up.unpack()
            if isinstance(key, str) and key in bounded:
                count = up.read_array_header()
                most, config_key = bounded[key]
                if count > most:
                    raise LimitExceeded(f"{type_name}: {key} has {count} items, more than the "
                                        f"{most} this receiver takes ({config_key})")
                for _ in range(count):
                    up.skip()
            else:
                up.skip()
    except LimitExceeded:
        raise
    except Exception:
        return


def _check_depth(obj: Any, limit: int) -> None:
    """Refuse a decoded msgpack tree nested deeper than `limit` (maps and lists only)."""
    stack = [(obj, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        children = node.values() if node.__class__ is dict else node
        for child in children:
            if child.__class__ is dict or child.__class__ is list:
                if depth >= limit:
                    raise LimitExceeded(f"frame 0 is nested deeper than {limit} levels "
                                        "(transport.max_depth)")
                push((child, depth + 1))


def decode_header(frames: Sequence[Frame], *, max_message_bytes: int | None = None,
                  limits: Limits | None = None) -> tuple[dict[str, Any], _Unpacker]:
    """Unpack frame 0 with arrays resolved; checks limits, version, id, type and frame use."""
    if not frames:
        raise ProtocolError("empty message: no frames")
    limits = limits or DEFAULT_LIMITS
    if max_message_bytes is not None and max_message_bytes != limits.max_bytes:
        limits = Limits(max_message_bytes, limits.max_frames, limits.max_items, limits.max_depth,
                        limits.items)
    _check_size(frames, limits)
    head = _buffer(frames[0])
    if limits.items:
        _check_items(head, limits)
    unpacker = _Unpacker(frames)
    most = min(limits.max_items, len(head))  # a header cannot hold more items than bytes
    try:
        header = msgpack.unpackb(
            head, object_hook=unpacker.hook, raw=False, strict_map_key=False,
            max_array_len=most, max_map_len=most, max_ext_len=0)
    except ProtocolError:
        raise
    except msgpack.StackError:
        raise LimitExceeded("frame 0 is nested deeper than msgpack decodes "
                            f"(transport.max_depth is {limits.max_depth})") from None
    except ValueError as exc:
        if "exceeds max_" in str(exc) and len(head) > limits.max_items:
            raise LimitExceeded(f"frame 0: a container holds more than {limits.max_items} "
                                "items (transport.max_items)") from None
        raise ProtocolError(f"frame 0 is not valid msgpack (ValueError: {exc})") from None
    except Exception as exc:  # msgpack raises many types on garbage; all mean the same thing
        raise ProtocolError(f"frame 0 is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if isinstance(header, (dict, list)):
        _check_depth(header, limits.max_depth)
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
                raise ProtocolError(
                    f"reply {id_}: malformed error {_short.repr(header.get('error'))}") from None
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
           max_message_bytes: int | None = None, limits: Limits | None = None) -> Envelope:
    """Decode a request, event or reply. For replies, `reply_type` validates the result."""
    try:
        header, _ = decode_header(frames, max_message_bytes=max_message_bytes, limits=limits)
        return envelope_from_header(header, reply_type=reply_type)
    except ProtocolError:
        raise
    except Exception as exc:  # the decoder's promise: nothing but ProtocolError escapes
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from None


def peek_id(frames: Sequence[Frame], limits: Limits | None = None) -> str | None:
    """Best effort: the `id` of a message that failed to decode, so the error can be answered.

    Reads frame 0's top-level keys in order up to `id` and skips other values in C, so a body
    that is garbage, too large or too deep after the id still gets its error reply."""
    try:
        up = _raw_unpacker(_buffer(frames[0]), limits or DEFAULT_LIMITS)
        for _ in range(up.read_map_header()):
            if up.unpack() == "id":
                value = up.unpack()
                return value if isinstance(value, str) and len(value) <= 256 else None
            up.skip()
    except Exception:
        pass
    return None
