"""A weight-broadcast process group that lives apart from any global torch.distributed state.

The trainer's rank 0 hosts the group's store (`tandem.weights.store`: a `HashStore` served over
CurveZMQ on the configured rendezvous host only, to clients holding the member secret key of the
rendezvous and to no one else); each group gets an epoch, and everything of epoch N (member
sign-ins, the backend choice, transfer metadata, progress, and the backend's own keys) lives
under the prefix `tandem/weights/<session>/<N>/`, where `session` names the trainer process so
a restarted trainer's epochs are never mistaken for the old ones. The backend object
(`ProcessGroupGloo` or `ProcessGroupNCCL`) is built directly on a PrefixStore, so it never
touches, and is never touched by, a default group the trainer may use for FSDP: no
`init_process_group`, no global registry. Every blocking step runs under a deadline; a
collective runs on a helper thread so a hang turns into an error naming the peer, after which
the group is abandoned and rebuilt under a new epoch.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist

from tandem.common import codec
from tandem.common.errors import ProtocolError
from tandem.common.messages.base import Message

from .tensors import WeightsError

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=Message)
T = TypeVar("T")

GRACE = 2.0  # seconds past a backend's own timeout before the guard gives up on the thread
INLINE_ALL = 2**62  # a store value is one frame: every array travels inline


class GroupAbandoned(WeightsError):
    """The trainer gave this group epoch up (a peer failed); join the next one announced."""


def current_key(session: str) -> str:
    """The key naming the session's current epoch (its value is the epoch number)."""
    return f"tandem/weights/{session}/current"


def epoch_prefix(session: str, epoch: int) -> str:
    return f"tandem/weights/{session}/{epoch}/"


def engine_member(explorer: str, worker: int = 0) -> str:
    """The member name of an explorer's engine worker `worker`, as both sides must spell it."""
    return f"{explorer}/w{worker}"


def engine_members(explorer: str, workers: int = 1) -> list[str]:
    """Member names of all of one explorer's engine workers (one per vLLM worker)."""
    return [engine_member(explorer, i) for i in range(workers)]


def encode(msg: Message, key: str) -> bytes:
    """`msg` as the value of store key `key`: one frame of the project codec, arrays inline."""
    frames = codec.encode_request(msg, key, inline_threshold=INLINE_ALL)
    return bytes(frames[0])


def decode(raw: bytes, cls: type[M], key: str) -> M:
    """The value of store key `key`, which must be a `cls` message (a ProtocolError otherwise)."""
    try:
        envelope = codec.decode([raw])
    except ProtocolError as exc:
        raise ProtocolError(f"store key {key}: {exc}") from None
    if not isinstance(envelope.body, cls):
        raise ProtocolError(f"store key {key}: expected a {cls.TYPE!r} message, "
                            f"got {envelope.type!r}")
    return envelope.body


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


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

    Polls `check` (which never blocks) with a short back-off rather than `store.wait`, whose
    timeouts the C++ side logs as warnings; `abandoned()` (the group was given up) is asked
    about twice a second so a member stops waiting as soon as the trainer gives the epoch up.
    """
    deadline = time.monotonic() + timeout
    next_look = time.monotonic() + 0.5
    pause = 0.001
    while not store.check(keys):
        now = time.monotonic()
        if now >= next_look:
            reason = abandoned()
            if reason is not None:
                raise GroupAbandoned(reason)
            next_look = now + 0.5
        if now >= deadline:
            return missing_keys(store, keys)
        time.sleep(min(pause, max(deadline - now, 0.0)))
        pause = min(pause * 2, 0.02)
    return []


def build_backend(backend: str, store: dist.Store, rank: int, world_size: int, *,
                  device: torch.device, bind_host: str, timeout: float) -> Any:
    """A `ProcessGroupGloo` or `ProcessGroupNCCL` built straight on `store`: no global group."""
    # Each backend's own timeout sits past the guard's (`run_guarded`), so the guard, which can
    # abort the group and name the peer, fires first instead of the backend's watchdog.
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout + 2 * GRACE)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout + 2 * GRACE)
        if device.index is not None:
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
        except Exception as exc:
            log.debug("weights.group.shutdown_failed", method=method, error=str(exc))


class Guarded:
    """`fn` running on a helper thread, to be waited for with a deadline.

    A raw collective cannot be interrupted where it runs, so it runs where the caller can stop
    waiting for it: on a hang, or as soon as `abandoned()` reports the group given up, `result`
    calls `on_hang` (tear the backend down, which unblocks NCCL; gloo's own timeout ends its
    thread) and raises TimeoutError or GroupAbandoned.
    """

    def __init__(self, fn: Callable[[], T]):
        self._result: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name="tandem-weights-collective")
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result["value"] = fn()
        except BaseException as exc:
            self._result["error"] = exc

    def result(self, timeout: float, on_hang: Callable[[], None],
               abandoned: Callable[[], str | None] = lambda: None) -> Any:
        deadline = time.monotonic() + timeout + GRACE
        while self._thread.is_alive():
            self._thread.join(min(0.5, max(deadline - time.monotonic(), 0.0)))
            if not self._thread.is_alive():
                break
            reason = abandoned()
            if reason is not None:
                on_hang()
                raise GroupAbandoned(reason)
            if time.monotonic() >= deadline:
                on_hang()
                raise TimeoutError(f"collective did not finish within {timeout:.1f} s")
        if "error" in self._result:
            raise self._result["error"]
        return self._result["value"]


def run_guarded(fn: Callable[[], T], timeout: float, on_hang: Callable[[], None],
                abandoned: Callable[[], str | None] = lambda: None) -> T:
    """Run `fn` on a helper thread and wait for it at most `timeout` (see `Guarded`)."""
    return Guarded(fn).result(timeout, on_hang, abandoned)


def start_broadcast(pg: Any, tensor: torch.Tensor) -> Guarded:
    """Start one broadcast from rank 0 on a backend object; `.result(...)` waits for it."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0

    def call() -> None:
        pg.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    return Guarded(call)


def broadcast(pg: Any, tensor: torch.Tensor, timeout: float,
              abandoned: Callable[[], str | None] = lambda: None) -> None:
    """One broadcast from rank 0 on a backend object, abandoned after `timeout`."""
    start_broadcast(pg, tensor).result(timeout, lambda: shutdown_backend(pg), abandoned)
