"""What the OpenAI-compatible endpoint records for each episode.

Every call the endpoint serves for an open episode leaves one `CallRecord` per choice: the exact
prompt and response token ids, the behaviour logprobs and the policy version. The `agent`
workflow turns an episode's records into trajectories (`workflows.agent.trajectories`):

- **chained**: every call's prompt begins with the previous call's prompt and response (the
  agent kept its conversation and appended to it). One trajectory: the first prompt, then each
  response with action mask 1, and whatever the agent, environment or tools added between two
  responses (tool results, the template's turn markers) with mask 0 and logprob 0.
- **otherwise** (a rewritten history, a call with n > 1, a fresh conversation midway): one
  trajectory per record, each its own prompt and response.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field



@dataclass
class CallRecord:
    """One choice of one served call, as the model saw and produced it."""

    episode: str
    route: str  # "chat" or "completion"
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str
    content: str | None = None  # the text returned to the client
    tool_call_ids: tuple[str, ...] = ()


@dataclass
class _Episode:
    records: list[CallRecord] = field(default_factory=list)


class CallLog:
    """Open episodes and their records, keyed by episode id (the request's API key)."""

    def __init__(self) -> None:
        self._open: dict[str, _Episode] = {}
        self.unrecorded = 0  # calls served for no open episode

    def open(self) -> str:
        episode = f"ep-{uuid.uuid4().hex}"
        self._open[episode] = _Episode()
        return episode

    def close(self, episode: str) -> list[CallRecord]:
        """The episode's records, in the order their calls finished; later calls are unrecorded."""
        ep = self._open.pop(episode, None)
        return ep.records if ep is not None else []

    def records(self, episode: str | None) -> list[CallRecord]:
        ep = self._open.get(episode) if episode is not None else None
        return ep.records if ep is not None else []

    def add(self, records: list[CallRecord]) -> None:
        for rec in records:
            ep = self._open.get(rec.episode)
            if ep is None:
                self.unrecorded += 1
            else:
                ep.records.append(rec)

    def find_assistant(self, episode: str | None, content: str | None,
                       tool_call_ids: tuple[str, ...]) -> CallRecord | None:
        """The chat record an assistant message in a later request repeats: by its tool call
        ids when it has some, else by its text (the newest such record)."""
        for rec in reversed(self.records(episode)):
            if rec.route != "chat":
                continue
            if tool_call_ids:
                if rec.tool_call_ids == tool_call_ids:
                    return rec
            elif not rec.tool_call_ids and (rec.content or "") == (content or ""):
                return rec
        return None


def versions_of(records: list[CallRecord]) -> list[int]:
    return sorted({r.version for r in records})

