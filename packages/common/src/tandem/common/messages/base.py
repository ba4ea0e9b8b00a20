"""Message base class, array field types, the type registry and the envelope-level messages."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo

PROTOCOL_VERSION = 1

REGISTRY: dict[str, type[Message]] = {}


class Message(BaseModel):
    """Base of every wire message; `TYPE` is its name on the wire."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    TYPE: ClassVar[str] = ""
    # List fields a receiver may bound, each with the config key that sets the bound; the RPC
    # server checks them on the raw array header, before decoding (see `RpcServer.register`).
    LIMITS: ClassVar[dict[str, str]] = {}

    def on_disk(self) -> Message:
        """This message as a file may hold it (the master's journal): with any secret it
        carries left out. Most carry none."""
        return self


class Request(Message):
    """A message that expects a reply of type `REPLY`."""

    REPLY: ClassVar[type[Message]]


def wire(type_name: str, reply: type[Message] | None = None):
    """Class decorator: register a message under its wire name (and its reply type)."""

    def register(cls: type[Message]) -> type[Message]:
        if type_name in REGISTRY and REGISTRY[type_name] is not cls:
            raise TypeError(f"message type {type_name!r} registered twice")
        cls.TYPE = type_name
        if reply is not None:
            cls.REPLY = reply
        REGISTRY[type_name] = cls
        return cls

    return register


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "dtype")


def _array_validator(dtype: str | None, ndim: int | None):
    target = np.dtype(dtype) if dtype is not None else None

    def validate(value: Any, info: ValidationInfo) -> Any:
        if value.__class__ is np.ndarray and (target is None or value.dtype == target):
            if ndim is not None and value.ndim != ndim:
                raise ValueError(f"expected {ndim}-d array, got shape {tuple(value.shape)}")
            return value
        if info.context and info.context.get("wire"):
            got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise ValueError(f"expected dtype {dtype}, got {got}" if isinstance(value, np.ndarray)
                             else f"expected an array, got {got}")
        if _is_torch_tensor(value):
            if target is None:
                return value
            value = value.detach().cpu().numpy()
        value = np.asarray(value)
        if target is not None and value.dtype != target:
            value = value.astype(target, casting="same_kind")
        if ndim is not None and value.ndim != ndim:
            raise ValueError(f"expected {ndim}-d array, got shape {tuple(value.shape)}")
        return value

    return validate


def Array(dtype: str | None = None, ndim: int | None = None) -> Any:
    """A numpy array field (or a torch tensor when `dtype` is None), checked for dtype and ndim.

    Python callers may pass lists or other dtypes, which are converted; values decoded from the
    wire must already have the declared dtype (a wrong dtype is a protocol error, not a cast).
    """
    return Annotated[Any, PlainValidator(_array_validator(dtype, ndim))]


class ErrorInfo(BaseModel):
    """Why a request failed: a stable code, a human-readable message, and optional back-off."""

    model_config = ConfigDict(extra="forbid")
    code: str
    message: str
    retry_after: float | None = Field(default=None, description="seconds to wait before retrying")


@wire("ok")
class Ok(Message):
    """Any server to any client: the request was carried out and has nothing to return."""


@wire("heartbeat.ack")
class HeartbeatAck(Message):
    """Any server to a client that sent a heartbeat: still alive."""

    name: str = ""


@wire("heartbeat", reply=HeartbeatAck)
class Heartbeat(Request):
    """Any component to a server it depends on: I am alive (any message also counts)."""

    name: str
    role: str = ""


class SnapshotEntry(BaseModel):
    """The newest event of one topic, as a late joiner needs it."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    topic: str
    seq: int
    type: str
    body: dict[str, Any]


@wire("pubsub.snapshot.reply")
class SnapshotReply(Message):
    """Publisher's RPC server to a subscriber: the newest event of each requested topic."""

    entries: list[SnapshotEntry]


@wire("pubsub.snapshot", reply=SnapshotReply)
class SnapshotRequest(Request):
    """Subscriber to the publisher's RPC server, on joining or after a gap: current state."""

    topics: list[str] = Field(default_factory=list, description="prefixes; empty means all")
