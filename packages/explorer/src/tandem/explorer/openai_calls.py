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
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, canonical JSON arguments) of each
    # every form of the response's text a client may send back, trimmed: the content as
    # answered, the decoded tokens with special tokens' text and without
    texts: frozenset[str] = frozenset()


@dataclass
class _Episode:
    records: list[CallRecord] = field(default_factory=list)


class CallLog:
    """Open episodes and their records, keyed by episode id (the request's API key)."""

    def __init__(self) -> None:
        self._open: dict[str, _Episode] = {}
        self.unrecorded = 0  # calls served for no open episode
        self.mismatches = 0  # experiences that failed `check`

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
                       tool_call_ids: tuple[str, ...],
                       tool_calls: tuple[tuple[str, str], ...] = ()) -> CallRecord | None:
        """The chat record an assistant message in a later request repeats (the newest such):
        by its tool call ids when it has some, else by its tool calls' names and arguments,
        else by its text in any form the endpoint answered it (streamed or whole, with special
        tokens' text or without, whitespace-trimmed)."""
        text = (content or "").strip()
        records = [r for r in reversed(self.records(episode)) if r.route == "chat"]
        if tool_call_ids:
            for rec in records:
                if rec.tool_call_ids == tool_call_ids:
                    return rec
        if tool_calls:
            for rec in records:
                if rec.tool_calls == tool_calls:
                    return rec
            return None
        for rec in records:
            if text in rec.texts or (not rec.tool_call_ids and text == (rec.content or "")):
                return rec
        return None

    def check(self, tokens: list[int], prompt_len: int, action_mask: list[int],
              logprobs: list[float], records: list[CallRecord]) -> str | None:
        """Why an experience is not token for token what the engine was given and produced
        for `records`, the calls it was built from; None when it is. Counted in
        `mismatches`."""
        why = token_mismatch(tokens, prompt_len, action_mask, logprobs, records)
        if why is not None:
            self.mismatches += 1
        return why


def token_mismatch(tokens: list[int], prompt_len: int, action_mask: list[int],
                   logprobs: list[float], records: list[CallRecord]) -> str | None:
    """The invariant an agent's experience keeps: each call's prompt is the experience's
    tokens up to that call's response, its response follows as the engine's own tokens with
    action mask 1 and the engine's logprobs, and no other token is an action."""
    mask = [0] * prompt_len + list(action_mask)
    lps = [0.0] * prompt_len + list(logprobs)
    if len(mask) != len(tokens) or len(lps) != len(tokens):
        return (f"{len(tokens)} tokens, but {len(mask)} mask entries and {len(lps)} logprobs "
                f"(prompt_len {prompt_len})")
    actions = 0
    for k, rec in enumerate(records):
        p, r = len(rec.prompt_ids), len(rec.token_ids)
        if tokens[:p] != rec.prompt_ids:
            at = next((i for i, (a, b) in enumerate(zip(tokens, rec.prompt_ids)) if a != b),
                      min(p, len(tokens)))
            return f"call {k}: the stored tokens leave the prompt the engine was given at {at}"
        if tokens[p:p + r] != rec.token_ids:
            return f"call {k}: the stored tokens after its prompt are not the engine's response"
        if any(m != 1 for m in mask[p:p + r]):
            return f"call {k}: a token of the engine's response is stored with action mask 0"
        if any(abs(a - b) > 1e-6 for a, b in zip(lps[p:p + r], rec.logprobs)):
            return f"call {k}: the stored logprobs are not the engine's"
        actions += r
    if sum(mask) != actions:
        return f"{sum(mask) - actions} tokens have action mask 1 but no call produced them"
    return None


def versions_of(records: list[CallRecord]) -> list[int]:
    return sorted({r.version for r in records})

