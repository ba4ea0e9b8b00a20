"""torch.distributed for the trainer: torchrun's environment, the process group, wrapping.

Launch with torchrun; every rank runs the same `tandem-trainer` command. Rank 0 alone talks to
the master, the buffer and the weight group; it broadcasts each batch to the other ranks as
tensors (never pickled objects). With CUDA the model is sharded with FSDP2 (`fully_shard` on
every decoder layer and the root); on CPU (gloo) it is replicated with DDP, unless
`trainer.parallel` says otherwise. `trainer.parallel: fsdp` in a single process shards over a
one-rank group: the same FSDP2 code as on many GPUs, on one device.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Iterator

import structlog
import torch
import torch.distributed as dist
from torch import nn

from tandem.common.errors import ConfigError

log = structlog.get_logger(__name__)


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
    return DistInfo(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                    int(os.environ.get("LOCAL_RANK", "0")))


def init(info: DistInfo, device: torch.device, timeout: float) -> None:
    """Join the process group (nccl on CUDA, gloo on CPU); a no-op for one process.

    `timeout` bounds every collective, so it must exceed the longest stretch rank 0 spends
    without one: a training step, a publication (the CLI passes `sync.timeout` + a margin).
    """
    if not info.enabled or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The checkpoint's state-dict API (torch.distributed.tensor underneath) is imported before
    # the group exists: imported after, it kept the gloo group's threads alive past `shutdown`
    # (tests/trainer/test_distributed.py). A single process imports it later, off its start-up.
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))


# How long the last barrier waits for the other ranks before this one leaves anyway.
SHUTDOWN_BARRIER_SECONDS = 30.0


def shutdown(timeout: float = SHUTDOWN_BARRIER_SECONDS) -> None:
    """Leave the process group in an order that cannot deadlock; every rank calls it last.

    Destroying a gloo group joins its worker threads, with the GIL held by whoever drops the
    group's last reference. A worker that has just finished a collective still holds that
    collective's tensors for a moment; when it drops the last reference to a tensor whose Python
    object is gone, it needs the GIL to free it, and the join never returns (issue 14 item 8:
    the rank hung for ever after `trainer.stopped`). So, in this order:

    1. the data-parallel wrapper is gone already (`Learner.release`), so DDP's reducer does not
       hold the group past this point and free it later from a finaliser;
    2. every tensor of this module's own collectives outlives the group (`_command`,
       `_last_batch`), so a worker never frees a Python-owned tensor;
    3. a barrier with a timeout: every rank is past its last collective, and gloo's workers
       finish the barrier, which owns no Python tensor;
    4. `destroy_process_group()` drops the group here, at a known point, with idle workers.
    """
    if not dist.is_initialized():
        return
    gc.collect()  # a wrapper kept only by a reference cycle lets go of the group now
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout))
        else:
            dist.barrier()
    except RuntimeError as exc:  # a rank that died or hung: leave without it
        log.warning("dist.barrier_failed", timeout=timeout, error=str(exc).splitlines()[0])
    dist.destroy_process_group()


def resolve_device(spec: str, info: DistInfo) -> torch.device:
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError([f"trainer.device: {spec!r} but CUDA is not available; "
                               f"set trainer.device: cpu"])
        if device.index is None:
            device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    return device


def wrap(actor: nn.Module, info: DistInfo, device: torch.device,
         parallel: str) -> tuple[nn.Module, str]:
    """Wrap for data parallelism; returns the module to call and the mode (none, ddp, fsdp)."""
    if not info.enabled and parallel != "fsdp":
        return actor, "none"
    if not info.enabled:
        _one_rank_group(device)
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


def _one_rank_group(device: torch.device) -> None:
    """A process group of this process alone, for FSDP2 on one device (`parallel: fsdp`).

    Its store is in memory (no port, no peer), so every collective returns at once; the state
    dict, checkpoint and publication then take the same sharded path as on many devices, and
    `shutdown` leaves the group as it leaves any other.
    """
    if dist.is_initialized():
        return
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (before the group: see `init`)

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


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


# -- rank 0 -> every rank: commands and batches as tensors ---------------------------------------

STEP, PUBLISH, CHECKPOINT, STOP, KEEPALIVE = 1, 2, 3, 4, 5

# While rank 0 waits (for the master, for groups) the other ranks sit in a broadcast, which the
# process group times out; rank 0 sends a keepalive this often so that only real hangs time out.
KEEPALIVE_SECONDS = 10.0


# The tensors of the last collectives live as long as the module (see `shutdown`): the command
# channel reuses one buffer, and each batch's tensors are kept until the next batch replaces them.
_command = torch.zeros(2, dtype=torch.long)
_last_batch: tuple[torch.Tensor, ...] = ()


def send_command(command: int, arg: int = 0) -> None:
    """Rank 0: tell every rank what comes next."""
    _command[0], _command[1] = command, arg
    dist.broadcast(_command, src=0)


def recv_command() -> tuple[int, int]:
    dist.broadcast(_command, src=0)
    command, arg = _command.tolist()
    return command, arg


def broadcast_experiences(experiences: list | None) -> list:
    """Rank 0 passes the batch, other ranks pass None; every rank returns it.

    Sent as flat tensors (tokens, masks, logprobs and a per-row header), not pickled objects.
    Ids are not sent: other ranks name rows by position and groups by their index.
    """
    import numpy as np

    from tandem.common.messages.experience import Experience

    if dist.get_rank() == 0:
        groups: dict[str, int] = {}
        header = torch.tensor([[int(e.tokens.shape[0]), e.prompt_len, e.policy_version,
                                groups.setdefault(e.group_id, len(groups))] for e in experiences],
                              dtype=torch.long)
        rewards = torch.tensor([e.reward for e in experiences], dtype=torch.float64)
        tokens = torch.from_numpy(np.concatenate([e.tokens for e in experiences]).astype(np.int64))
        action = torch.from_numpy(
            np.concatenate([e.action_mask for e in experiences]).astype(np.int64))
        logprobs = torch.from_numpy(np.concatenate([e.logprobs for e in experiences]))
        sizes = torch.tensor([header.shape[0], tokens.numel(), action.numel()], dtype=torch.long)
    else:
        sizes = torch.zeros(3, dtype=torch.long)
    dist.broadcast(sizes, src=0)
    n, n_tokens, n_action = sizes.tolist()
    if dist.get_rank() != 0:
        header = torch.zeros((n, 4), dtype=torch.long)
        rewards = torch.zeros(n, dtype=torch.float64)
        tokens = torch.zeros(n_tokens, dtype=torch.long)
        action = torch.zeros(n_action, dtype=torch.long)
        logprobs = torch.zeros(n_action, dtype=torch.float32)
    global _last_batch
    _last_batch = (sizes, header, rewards, tokens, action, logprobs)
    for tensor in (header, rewards, tokens, action, logprobs):
        dist.broadcast(tensor, src=0)
    if dist.get_rank() == 0:
        return experiences
    out, t_at, a_at = [], 0, 0
    for i, (length, prompt_len, version, group) in enumerate(header.tolist()):
        r = length - prompt_len
        out.append(Experience(
            id=str(i), task_id=f"g{group}", group_id=f"g{group}",
            tokens=tokens[t_at:t_at + length].numpy().astype(np.int32), prompt_len=prompt_len,
            action_mask=action[a_at:a_at + r].numpy().astype(np.uint8),
            logprobs=logprobs[a_at:a_at + r].numpy(), reward=float(rewards[i]),
            policy_version=version))
        t_at += length
        a_at += r
    return out
