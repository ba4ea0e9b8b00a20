"""A weight-broadcast process group that lives apart from any global torch.distributed state.

The trainer's rank 0 hosts a TCPStore; each group gets an epoch, and everything of epoch N
(member sign-ins, the backend choice, transfer metadata, progress, and the backend's own keys)
lives under the prefix `tandem/weights/<N>/`. The backend object (`ProcessGroupGloo` or
`ProcessGroupNCCL`) is built directly on a PrefixStore, so it never touches, and is never
touched by, a default group the trainer may use for FSDP: no `init_process_group`, no global
registry. Every blocking step runs under a deadline; a collective runs on a helper thread so a
hang turns into an error naming the peer, after which the group is abandoned and rebuilt under
a new epoch.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import structlog
import torch
import torch.distributed as dist

from ..errors import ProtocolError
from ..messages.base import Message
from .tensors import WeightsError

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Message)
T = TypeVar("T")

EPOCH_KEY = "tandem/weights/epoch"
GRACE = 2.0  # seconds past a backend's own timeout before the guard gives up on the thread


def epoch_prefix(epoch: int) -> str:
    return f"tandem/weights/{epoch}/"


def engine_member(explorer: str, worker: int = 0) -> str:
    """The member name of an explorer's engine worker `worker`, as both sides must spell it."""
    return f"{explorer}/w{worker}"


def engine_members(explorer: str, workers: int = 1) -> list[str]:
    """Member names of all of one explorer's engine workers (one per vLLM worker)."""
    return [engine_member(explorer, i) for i in range(workers)]


def encode(msg: Message) -> bytes:
    return msgpack.packb({"type": msg.TYPE, **msg.model_dump(mode="python")})


def decode(raw: bytes, cls: type[M], where: str) -> M:
    try:
        body = msgpack.unpackb(raw)
        kind = body.pop("type", None)
        if kind != cls.TYPE:
            raise ValueError(f"expected {cls.TYPE!r}, got {kind!r}")
        return cls.model_validate(body)
    except Exception as exc:
        raise ProtocolError(f"{where}: not a valid {cls.TYPE} message: {exc}") from None


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def connect_store(host: str, port: int, timeout: float, *, serve: bool = False) -> dist.TCPStore:
    """The group's TCPStore: hosted here when `serve`, else a client of the trainer's."""
    return dist.TCPStore(host, port, None, serve, timedelta(timeout), wait_for_workers=False)


def local_address_towards(host: str, port: int) -> str:
    """The local IP that packets to (host, port) leave from: what gloo should bind for peers."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def missing_keys(store: dist.Store, keys: list[str]) -> list[str]:
    return [k for k in keys if not store.check([k])]


def wait_keys(store: dist.Store, keys: list[str], timeout: float,
              abandoned: Callable[[], str | None] = lambda: None) -> list[str]:
    """Wait until every key exists; returns the keys still missing when `timeout` runs out.

    Waits in short slices so that `abandoned()` (the group was given up) is noticed early.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(min(left, 0.5)))
            return []
        except dist.DistStoreError:
            pass
        reason = abandoned()
        if reason is not None:
            raise GroupAbandoned(reason)
        if time.monotonic() >= deadline:
            return missing_keys(store, keys)


class GroupAbandoned(WeightsError):
    """The trainer gave this group epoch up (a peer failed); join the next one announced."""


def build_backend(backend: str, store: dist.Store, rank: int, world_size: int, *,
                  device: torch.device, bind_host: str, timeout: float) -> Any:
    """A `ProcessGroupGloo` or `ProcessGroupNCCL` built straight on `store`: no global group."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        # The backend's own timeout sits past the guard's, so the guard (which can abort the
        # communicator and name the peer) fires first instead of NCCL's watchdog.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(timeout + 2 * GRACE)
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"unknown weight-sync backend {backend!r} (weights.backend: gloo or nccl)")


def shutdown_backend(pg: Any) -> None:
    """Tear a backend down without waiting on peers; an already dead group is fine."""
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as exc:  # noqa: BLE001 - best effort on a group we are leaving
            log.debug("weights.group.shutdown_failed", method=method, error=str(exc))


def run_guarded(fn: Callable[[], T], timeout: float, on_hang: Callable[[], None]) -> T:
    """Run `fn` on a helper thread; if it neither returns nor raises in time, call `on_hang`
    (abort the group) and raise TimeoutError. A raw collective cannot be interrupted where it
    runs, so it runs where the caller can stop waiting for it."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="tandem-weights-collective", daemon=True)
    thread.start()
    thread.join(timeout + GRACE)
    if thread.is_alive():
        on_hang()
        thread.join(GRACE)
        raise TimeoutError(f"collective did not finish within {timeout:.1f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def broadcast(pg: Any, tensor: torch.Tensor, timeout: float) -> None:
    """One broadcast from rank 0 on a backend object, abandoned after `timeout`."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0

    def call() -> None:
        pg.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    run_guarded(call, timeout, lambda: shutdown_backend(pg))

