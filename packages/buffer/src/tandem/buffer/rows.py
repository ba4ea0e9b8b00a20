"""An experience as a database row: small fields as one msgpack blob, arrays as their raw bytes.

Arrays are stored as the exact bytes of the numpy buffers (never lists), so what the trainer
samples is bit-identical to what the explorer put, NaN payloads included.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from tandem.common.messages import Experience

from .store import BadPut

_META_FIELDS = ("task_id", "prompt_len", "reward", "rewards", "policy_version", "explorer",
                "created_at", "info")
_INT32 = np.dtype("int32")
_UINT8 = np.dtype("uint8")
_FLOAT32 = np.dtype("float32")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not storable (use plain numbers and strings)")


def _bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def to_row(exp: Experience) -> tuple[str, str, bytes, bytes, bytes, bytes, int, bytes | None,
                                     str | None]:
    """(id, group_id, meta, tokens, action_mask, logprobs, nbytes, token_versions, images) for
    an INSERT; token_versions is NULL when every token is at `policy_version`, images (the
    image hashes, space-separated) when the prompt shows none."""
    meta = {name: getattr(exp, name) for name in _META_FIELDS}
    try:
        packed = msgpack.packb(meta, default=_plain, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadPut(f"experience {exp.id}: info or rewards cannot be stored: {exc}") from None
    return (exp.id, exp.group_id, packed, _bytes(exp.tokens), _bytes(exp.action_mask),
            _bytes(exp.logprobs), exp.nbytes,
            None if exp.token_versions is None else _bytes(exp.token_versions),
            " ".join(exp.images) or None)


def from_row(id_: str, group_id: str, meta: bytes, tokens: bytes, action_mask: bytes,
             logprobs: bytes, token_versions: bytes | None = None,
             images: str | None = None) -> Experience:
    """The experience a row holds; trusted (we wrote it), so built without re-validation."""
    fields = msgpack.unpackb(meta, raw=False, strict_map_key=False)
    return Experience.model_construct(
        id=id_, group_id=group_id,
        tokens=np.frombuffer(tokens, dtype=_INT32),
        action_mask=np.frombuffer(action_mask, dtype=_UINT8),
        logprobs=np.frombuffer(logprobs, dtype=_FLOAT32),
        token_versions=(None if token_versions is None
                        else np.frombuffer(token_versions, dtype=_INT32)),
        images=images.split() if images else [],
        **fields)
