"""What both weight paths share: dtype names, bucket planning, and loading into a module."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tandem.common.errors import TandemError
from tandem.common.messages.weights import BucketSpec, TensorSpec


class WeightsError(TandemError):
    """A weight version is missing, corrupt or does not match what it claims; says which file."""


#: `model.dtype` (the config's choice for inference and published weights) as a torch dtype.
MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


def model_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `model.dtype` name; another name is a ValueError naming the key."""
    try:
        return MODEL_DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype {name!r}: expected one of {sorted(MODEL_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the name on the wire and in manifests)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> `torch.bfloat16`; an unknown name is a WeightsError."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsError(f"unknown tensor dtype {name!r}")
    return dtype


def check_unique_names(tensors: list[tuple[str, torch.Tensor]], what: str) -> None:
    """A name given twice would silently keep one of the two: refuse it, naming it."""
    seen: set[str] = set()
    for name, _ in tensors:
        if name in seen:
            raise WeightsError(f"{what}: tensor name {name!r} is given twice")
        seen.add(name)


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> tuple[list[int], list[BucketSpec]]:
    """Group tensors by dtype (first-seen order) and pack each group into buckets.

    Returns the send order (indexes into `specs`, grouped by dtype) and the buckets over that
    order. A bucket holds at most `bucket_bytes` unless one tensor alone is larger, in which
    case that tensor is a bucket by itself: one collective per bucket, never one per tensor.
    """
    by_dtype: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        by_dtype.setdefault(spec.dtype, []).append(i)
    order: list[int] = []
    buckets: list[BucketSpec] = []
    for dtype, indexes in by_dtype.items():
        itemsize = torch.empty((), dtype=torch_dtype(dtype)).element_size()
        for i in indexes:
            numel = _numel(specs[i].shape)
            last = buckets[-1] if buckets else None
            if (last is not None and last.dtype == dtype
                    and (last.numel + numel) * itemsize <= bucket_bytes):
                last.numel += numel
                last.count += 1
            else:
                buckets.append(BucketSpec(dtype=dtype, numel=numel, first=len(order), count=1))
            order.append(i)
    return order, buckets


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_into(module: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
              *, strict: bool = True) -> int:
    """Copy (name, tensor) pairs into a module's parameters and buffers; returns how many.

    The plain-PyTorch `load_weights`: what the Hugging Face engine and the tests call with
    either weight path's iterator. Tied weights are listed once by `named_parameters()` and
    filled once. With `strict`, a name the module lacks, a shape or dtype that differs, or a
    parameter that got no tensor is a WeightsError naming it.
    """
    targets = dict(module.named_parameters())
    targets.update(module.named_buffers())
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                if strict:
                    raise WeightsError(f"load_into: the module has no parameter or buffer {name!r}")
                continue
            if target.shape != tensor.shape:
                raise WeightsError(f"load_into: {name!r} has shape {list(target.shape)} in the "
                                   f"module, {list(tensor.shape)} in the weights")
            if strict and target.dtype != tensor.dtype:
                raise WeightsError(f"load_into: {name!r} is {dtype_name(target.dtype)} in the "
                                   f"module, {dtype_name(tensor.dtype)} in the weights")
            target.copy_(tensor)
            filled.add(name)
    if strict:
        missing = sorted(set(dict(module.named_parameters())) - filled)
        if missing:
            raise WeightsError(f"load_into: no weights for {len(missing)} parameters, "
                               f"e.g. {missing[:3]}")
    return len(filled)
