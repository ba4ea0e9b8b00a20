"""torch.distributed for the trainer: torchrun's environment, the process group, wrapping.

Launch with torchrun; every rank runs the same `tandem-trainer` command. Rank 0 alone talks to
the master, the buffer and the weight group; it broadcasts each batch to the other ranks as
tensors (never pickled objects). With CUDA the model is sharded with FSDP2 (`fully_shard` on
every decoder layer and the root); on CPU (gloo) it is replicated with DDP, unless
`trainer.parallel` says otherwise.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env() -> DistInfo:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or a single process."""
    return DistInfo(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                    int(os.environ.get("LOCAL_RANK", 0)))


def init(info: DistInfo, device: torch.device, timeout: float) -> None:
    """Join the process group (nccl on CUDA, gloo on CPU); a no-op for one process."""
    if not info.enabled or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_device(spec: str, info: DistInfo) -> torch.device:
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"trainer.device is {spec!r} but CUDA is not available; set trainer.device: cpu")
        if device.index is None:
            device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    return device


def wrap(actor: nn.Module, info: DistInfo, device: torch.device, parallel: str) -> tuple[nn.Module, str]:
    """Wrap for data parallelism; returns the module to call and the mode (none, ddp, fsdp)."""
    if not info.enabled:
        return actor, "none"
    mode = parallel if parallel != "auto" else ("fsdp" if device.type == "cuda" else "ddp")
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in _decoder_layers(actor):
            fully_shard(layer)
        fully_shard(actor)
        return actor, "fsdp"
    from torch.nn.parallel import DistributedDataParallel
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(actor, device_ids=ids), "ddp"


def _decoder_layers(actor: nn.Module) -> list[nn.Module]:
    for module in actor.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    return []


@contextmanager
def gradient_sync(wrapped: nn.Module, mode: str, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if mode == "ddp" and not sync:
        with wrapped.no_sync():
            yield
        return
    if mode == "fsdp":
        wrapped.set_requires_gradient_sync(sync)
    with nullcontext():
        yield


def unwrap(wrapped: nn.Module) -> nn.Module:
    return getattr(wrapped, "module", wrapped)
