"""`online`: RL from live traffic. An application points its OpenAI client's `base_url` at the
explorer's endpoint; each conversation is an episode that it opens with a group key, holds under
its own API key, and closes by attaching a reward, possibly minutes later
(docs/explorer.md#online).

- `POST /v1/episodes {"group": KEY}` opens an episode: its id is the API key the application's
  client sends with the conversation's calls, so the endpoint records them (`openai_calls`).
- `POST /v1/episodes/{id}/reward {"reward": R, "components": {...}}` closes it. Its calls become
  experiences by the agent workflow's rule (one chained experience when the conversation was
  extended turn by turn, the model's own tokens spliced; else one per call).
- Episodes are grouped by KEY, `explorers[].repeat_times` to a group; the next episode opened
  with a full group's key starts a new group. A group is complete when each of its episodes is
  rewarded or expired; its rewarded episodes are trained together.
- An episode not rewarded within `workflow_args.episode_ttl` seconds of its opening expires: its
  calls are dropped, never trained, counted (`tandem_explorer_online_episodes{state="expired"}`)
  and traced (`online_expired`). A group that has not filled within that time closes with the
  episodes it has.

Each step's leased tasks are slots (the `online` taskset reader makes them): the step takes that
many complete groups, oldest first, waiting at most `workflow_args.wait_timeout`, and the explorer
puts and reports them as any step's. The master's sync plan decides when the weights change; the
endpoint answers under whatever version the engine holds, and each experience keeps the version
of each call (docs/design.md §3: the group's version is its oldest).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.common.messages.experience import Experience, Task

from .openai_calls import CallRecord, versions_of
from .openai_requests import APIError, error_of
from .workflows.agent import checked, episode_rows
from .workflows.base import (
    RolloutContext, Workflow, WorkflowArgs, make_experience, settle_group_versions)

log = structlog.get_logger(__name__)

# ids of ended episodes kept to say why a late reward call is refused (expired or rewarded)
_ENDED_KEPT = 100_000


class OnlineArgs(WorkflowArgs):
    episode_ttl: float = Field(default=600.0, gt=0,
                               description="seconds from an episode's opening to its reward; "
                                           "past it the episode expires and is never trained")
    wait_timeout: float = Field(default=600.0, gt=0,
                                description="seconds a step waits for its groups to complete "
                                            "before the explorer fails naming this key")


class OpenBody(BaseModel):
    """`POST /v1/episodes`: the group the new episode belongs to."""

    model_config = ConfigDict(extra="forbid", strict=True)
    group: str = Field(min_length=1, max_length=256)


class RewardBody(BaseModel):
    """`POST /v1/episodes/{id}/reward`: the episode's reward and its named components."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    reward: float
    components: dict[str, float] = Field(default_factory=dict)


@dataclass
class OnlineEpisode:
    """One conversation of the application, from its opening to its reward or expiry."""

    id: str
    group: OnlineGroup
    opened: float  # on the book's clock
    state: str = "open"  # open, rewarded, expired
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    records: list[CallRecord] = field(default_factory=list)
    seconds: float = 0.0  # opening to reward
    reason: str = "ok"
    index: int = 0


@dataclass
class OnlineGroup:
    """The episodes one group key gathered: at most `size`, trained together."""

    key: str
    task: Task
    size: int
    opened: float
    episodes: list[OnlineEpisode] = field(default_factory=list)
    short: bool = False  # closed for new episodes before it filled (episode_ttl)

    @property
    def complete(self) -> bool:
        return ((len(self.episodes) >= self.size or self.short)
                and all(e.state != "open" for e in self.episodes))

    @property
    def rewarded(self) -> list[OnlineEpisode]:
        return [e for e in self.episodes if e.state == "rewarded"]


class EpisodeBook:
    """Open episodes, their groups, and the complete groups waiting for a step. Runs on the
    event loop; `clock` is monotonic seconds (a test passes its own)."""

    def __init__(self, calls: Any, group_size: int, ttl: float, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_expire: Callable[[OnlineEpisode], None] | None = None):
        self.calls = calls  # the endpoint's CallLog
        self.group_size = group_size
        self.ttl = ttl
        self.clock = clock
        self.on_expire = on_expire
        self._open: dict[str, OnlineEpisode] = {}
        self._filling: dict[str, OnlineGroup] = {}  # key -> the group its next episode joins
        self._pending: list[OnlineGroup] = []
        self.ready: deque[OnlineGroup] = deque()
        self._ended: OrderedDict[str, OnlineEpisode] = OrderedDict()
        self.changed = asyncio.Event()
        self.counts = {"opened": 0, "rewarded": 0, "expired": 0, "trained": 0}
        self.groups_dropped = 0  # complete with no rewarded episode

    def open(self, key: str) -> OnlineEpisode:
        self.sweep()
        group = self._filling.get(key)
        if group is None:
            task_id = f"online-{uuid.uuid4().hex[:12]}"
            group = OnlineGroup(key, Task(id=task_id, payload={"group": key}), self.group_size,
                                self.clock())
            self._filling[key] = group
            self._pending.append(group)
        episode = OnlineEpisode(self.calls.open(), group, self.clock(),
                                index=len(group.episodes))
        group.episodes.append(episode)
        if len(group.episodes) >= group.size:
            del self._filling[key]
        self._open[episode.id] = episode
        self.counts["opened"] += 1
        return episode

    def reward(self, episode_id: str, body: RewardBody) -> OnlineEpisode:
        self.sweep()
        episode = self._open.get(episode_id)
        if episode is None:
            ended = self._ended.get(episode_id)
            if ended is None:
                raise APIError(404, f"episode {episode_id!r} was never opened here (open one "
                               "with POST /v1/episodes)", code="episode_not_found")
            if ended.state == "expired":
                raise APIError(410, f"episode {episode_id!r} expired {self.ttl:g}s after it "
                               "opened, with no reward (workflow_args.episode_ttl); it is not "
                               "trained", code="episode_expired")
            raise APIError(409, f"episode {episode_id!r} already has its reward "
                           f"({ended.reward:g})", code="episode_closed")
        if not self.calls.records(episode_id):
            raise APIError(400, f"episode {episode_id!r} has made no call yet: nothing to reward "
                           f"(send its calls with api_key={episode_id!r} first)",
                           code="episode_empty")
        episode.records = self.calls.close(episode_id)
        episode.state, episode.reward = "rewarded", body.reward
        episode.components = {"reward": body.reward, **body.components}
        episode.seconds = self.clock() - episode.opened
        self.counts["rewarded"] += 1
        self._end(episode)
        return episode

    def sweep(self) -> None:
        """Expire what is past `ttl`: open episodes, and groups still filling."""
        now = self.clock()
        for key, group in list(self._filling.items()):
            if now >= group.opened + self.ttl:
                group.short = True
                del self._filling[key]
        for episode in [e for e in self._open.values() if now >= e.opened + self.ttl]:
            self.calls.close(episode.id)  # dropped: its later calls are not recorded either
            episode.state = "expired"
            self.counts["expired"] += 1
            if self.on_expire is not None:
                self.on_expire(episode)
            self._end(episode)
        self._settle()

    def next_deadline(self) -> float | None:
        """The clock time of the next expiry, if anything can expire."""
        times = [e.opened + self.ttl for e in self._open.values()]
        times += [g.opened + self.ttl for g in self._filling.values()]
        return min(times, default=None)

    def take(self) -> OnlineGroup | None:
        return self.ready.popleft() if self.ready else None

    def _end(self, episode: OnlineEpisode) -> None:
        del self._open[episode.id]
        self._ended[episode.id] = episode
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        self._settle()

    def _settle(self) -> None:
        still = []
        for group in self._pending:
            if not group.complete:
                still.append(group)
            elif group.rewarded:
                self.ready.append(group)
                self.changed.set()
            else:
                self.groups_dropped += 1
        self._pending = still

    def stats(self) -> dict[str, int]:
        return {**self.counts, "open": len(self._open), "groups_ready": len(self.ready),
                "groups_dropped": self.groups_dropped}


class Online(Workflow):
    """Experiences from live traffic; see the module docstring."""

    Args = OnlineArgs

    def __init__(self, tokenizer: Any, args: dict[str, Any] | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(tokenizer, args)
        self.clock = clock
        self.book: EpisodeBook | None = None
        self.endpoint: Any = None

    def attach(self, endpoint: Any, *, repeat_times: int, tracer: Any = None,
               metrics: Any = None) -> None:
        if endpoint is None:
            raise RuntimeError("the online workflow needs the explorer's OpenAI endpoint")
        self.endpoint = endpoint

        def expired(episode: OnlineEpisode) -> None:
            log.warning("online.episode_expired", episode=episode.id, group=episode.group.key,
                        calls=len(self.endpoint.calls.records(episode.id)) or None,
                        ttl=self.args.episode_ttl)
            if tracer is not None:
                tracer.event("online_expired", episode=episode.id, group=episode.group.key)

        self.book = EpisodeBook(endpoint.calls, repeat_times, self.args.episode_ttl,
                                clock=self.clock, on_expire=expired)
        if metrics is not None:
            metrics.gauge_fn("online_episodes", "online episodes by state: opened, rewarded, "
                             "expired (never trained), trained, open; groups_ready, "
                             "groups_dropped (no episode rewarded)", self.book.stats,
                             labels=("state",))
        add_routes(endpoint.app, self.book)

    async def run(self, tasks: list[Task], ctx: RolloutContext) -> list[Experience]:
        book = self.book
        if book is None:
            raise RuntimeError("the online workflow was not attached to the explorer's endpoint")
        # the wait is bounded in real time; expiry follows the book's clock
        give_up, out = time.monotonic() + self.args.wait_timeout, []
        for taken in range(len(tasks)):
            while (group := book.take()) is None:
                book.sweep()
                if book.ready:
                    continue
                left = give_up - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"online: {taken} of {len(tasks)} "
                        f"groups complete after workflow_args.wait_timeout = "
                        f"{self.args.wait_timeout:g}s; is the application opening episodes and "
                        f"attaching rewards at {self.endpoint.url}/episodes?")
                deadline = book.next_deadline()
                wait = left if deadline is None else max(0.0, min(left, deadline - self.clock()))
                book.changed.clear()
                try:
                    await asyncio.wait_for(book.changed.wait(), wait)
                except TimeoutError:
                    pass
            experiences = self._experiences(group, ctx)
            book.counts["trained"] += len(group.rewarded)
            if ctx.on_group is not None:
                await ctx.on_group(experiences)
            out += experiences
        return out

    def _experiences(self, group: OnlineGroup, ctx: RolloutContext) -> list[Experience]:
        rows = episode_rows(group.rewarded)
        out = []
        for index, (episode, traj, rule, records) in enumerate(rows):
            for rec in records:  # the version that answered each call, per token
                at = len(rec.prompt_ids) - len(traj.prompt_ids)
                traj.versions[at:at + len(rec.token_ids)] = [rec.version] * len(rec.token_ids)
            out.append(checked(self.endpoint, make_experience(
                group.task, index, traj, ctx, reward=episode.reward,
                rewards=episode.components,
                info={"group_size": len(rows), "group_key": group.key,
                      "online_episode": episode.id, "episode": episode.index, "rule": rule,
                      "reward_reason": "ok", "calls": len(episode.records),
                      "call_versions": versions_of(episode.records),
                      "finish_reasons": [r.finish_reason for r in episode.records],
                      "episode_s": episode.seconds}), records))
        return settle_group_versions(out)


def add_routes(app: Any, book: EpisodeBook) -> None:
    """The episode routes on the endpoint's app (FastAPI)."""

    @app.post("/v1/episodes")
    async def open_episode(request: Request) -> Any:
        try:
            body = _validated(OpenBody, await _json(request))
            episode = book.open(body.group)
        except APIError as exc:
            return exc.response()
        return {"id": episode.id, "object": "episode", "group": body.group,
                "group_size": book.group_size, "index": episode.index,
                "expires_in": book.ttl}

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward_episode(episode_id: str, request: Request) -> Any:
        try:
            body = _validated(RewardBody, await _json(request))
            episode = book.reward(episode_id, body)
        except APIError as exc:
            return exc.response()
        return {"id": episode.id, "object": "episode", "status": "rewarded",
                "group": episode.group.key, "reward": episode.reward,
                "calls": len(episode.records)}


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}",
                       code="invalid_json") from None


def _validated(model: type[BaseModel], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        param, message = error_of(exc)
        raise APIError(400, message, param=param) from None


def read_slots(path: str, split: str | None = None,
               key: str = "master.taskset") -> list[dict[str, Any]]:
    """The taskset reader `online` (`master.taskset: {reader: online, path: "N"}`): N slots
    (default 1024; `epochs` repeats them), each a place for one group of live traffic. Their
    content is not read: they pace the master's steps."""
    count = int(path) if path else 1024
    if count < 1:
        raise ValueError(f"{key}.path: {path!r} slots; give a positive number")
    return [{"id": f"slot-{i}"} for i in range(count)]
