"""Application heartbeats: any message counts as a sign of life; silence past `liveness` is death."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from .errors import PeerDead, RequestFailed
from .messages.base import Heartbeat
from .messages.master import Goodbye

log = structlog.get_logger(__name__)


class Liveness:
    """Server side: when each peer was last heard from, and which are silent past `liveness`."""

    def __init__(self, liveness: float):
        self.liveness = liveness
        self.last_seen: dict[str, float] = {}

    def touch(self, peer: str, now: float | None = None) -> None:
        self.last_seen[peer] = time.monotonic() if now is None else now

    def silent(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [p for p, t in self.last_seen.items() if now - t > self.liveness]

    def forget(self, peer: str) -> None:
        self.last_seen.pop(peer, None)



async def say_goodbye(master, name: str, stop_grace: float) -> None:
    """A registered component's last call to the master (`master`, an RpcClient): `Goodbye`,
    so that after a `Stop` the master need not serve out `master.stop_grace` for it. One attempt,
    bounded by that grace (at least 0.5 s): the master waits no longer for it, and a master that
    is gone or predates the message costs no more. Never raises: leaving goes on either way."""
    try:
        await master.call(Goodbye(name=name), timeout=max(stop_grace, 0.5), retries=0,
                          timeout_key="master.stop_grace")
    except (PeerDead, RequestFailed) as exc:
        log.info("goodbye.unheard", name=name, error=str(exc))


class Heartbeater:
    """Client side: pings a server every `interval`.

    It sends its own heartbeat even while other calls on the same client get replies: a reply
    to a request the server does not count as life (a subscriber's snapshot request) must not
    let the server's `liveness` run out. `on_dead(peer)` runs once when the server has been
    silent past `liveness`, `on_alive(peer)` once when it answers again, and
    `on_refused(error)` each time the server refuses the heartbeat (e.g. `declared_dead`);
    `sent_at` is then when that heartbeat was sent (monotonic), so that a caller can tell a
    refusal of a request sent before some change of its own (a new registration) from one after.
    """

    def __init__(self, client, *, name: str, role: str = "", interval: float = 1.0,
                 liveness: float = 10.0,
                 on_dead: Callable[[str], Awaitable[None] | None] | None = None,
                 on_alive: Callable[[str], Awaitable[None] | None] | None = None,
                 on_refused: Callable[[RequestFailed], Awaitable[None] | None] | None = None):
        self.client = client
        self.name = name
        self.role = role
        self.interval = interval
        self.liveness = liveness
        self.on_dead = on_dead
        self.on_alive = on_alive
        self.on_refused = on_refused
        self.alive = True
        self.sent_at = float("-inf")  # the latest heartbeat's send (monotonic)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.client.peer}")

    async def _notify(self, callback, peer: str) -> None:
        if callback is not None:
            result = callback(peer)
            if asyncio.iscoroutine(result):
                await result

    async def _run(self) -> None:
        while True:
            sent = self.sent_at = time.monotonic()
            try:
                await self.client.call(Heartbeat(name=self.name, role=self.role),
                                       timeout=self.liveness, retries=0,
                                       timeout_key="transport.liveness")
                if not self.alive:
                    self.alive = True
                    log.info("peer.alive", peer=self.client.peer)
                    await self._notify(self.on_alive, self.client.peer)
            except PeerDead:
                if self.alive:
                    self.alive = False
                    log.warning("peer.dead", peer=self.client.peer, silent_for=self.liveness,
                                hint="raise transport.liveness if it is only slow")
                    await self._notify(self.on_dead, self.client.peer)
                # the interval's rest follows: none after a silence that lasted the whole call,
                # all of it after one refused at once (`RpcClient.bound_for_stop`: gone peer)
            except RequestFailed as exc:
                log.debug("heartbeat.refused", peer=self.client.peer, error=str(exc))
                await self._notify(self.on_refused, exc)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - sent)))

    async def close(self) -> None:
        if self._task is not None:
            # cancelled again until it ends: a cancellation that lands as an awaited call
            # completes can be swallowed on the way (asyncio.wait_for in Python 3.11 does)
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait((self._task,), timeout=0.5)
            self._task = None
