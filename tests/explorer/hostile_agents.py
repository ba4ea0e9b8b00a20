"""Agents that misbehave, for tests/explorer/test_agent_isolation.py. Each runs in its own
episode's sandbox; the test's endpoint adds the `/v1/gate/...` routes they wait on, so the
moments they act at are the test's own events, never a sleep."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import socket
import sys

import httpx

KEY = re.compile(r"ep-[0-9a-f]{32}")


async def _gate(client, name: str) -> None:
    await client.get(f"/gate/{name}", cast_to=httpx.Response)


async def _ask(client, prompt: str, **kwargs):
    return await client.chat.completions.create(
        model="policy", max_tokens=4, messages=[{"role": "user", "content": prompt}], **kwargs)


async def party(task: dict, client) -> dict:
    """The victims and the thieves of one step, by the task's role."""
    return await (victim if task["role"] == "victim" else thief)(task, client)


async def victim(task: dict, client) -> dict:
    """One call, then wait (episode open, client alive) until every thief has finished."""
    await _ask(client, task["prompt"])
    await _gate(client, "victim")
    return {"reward": 1.0}


def _keys_in(text: str, own: str) -> set[str]:
    return {k for k in KEY.findall(text) if k != own}


def _read(path: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("latin-1")
    except OSError:
        return ""


async def thief(task: dict, client) -> dict:
    """Once the victims wait with their episodes open, look for their keys everywhere this
    process can reach, and call the endpoint with every key found."""
    await _gate(client, "thief")
    own = client.api_key
    found: set[str] = set()
    for obj in gc.get_objects():  # the hole of the in-process agent: other episodes' clients
        if type(obj).__name__ in ("AsyncOpenAI", "OpenAI"):
            found |= _keys_in(str(obj.api_key), own)
        elif isinstance(obj, str) and obj.startswith("ep-"):
            found |= _keys_in(obj, own)
    found |= _keys_in(" ".join(os.environ.values()), own)
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in {*pids, str(os.getppid()), "1"}:
        for name in ("environ", "cmdline", "maps"):
            found |= _keys_in(_read(f"/proc/{pid}/{name}"), own)
    code = tuple(p for p in sys.path if p)
    for top, dirs, files in os.walk("/"):
        if top.startswith(("/proc", "/sys")) or top.startswith(code):
            dirs[:] = []
            continue
        for name in files:
            found |= _keys_in(name, own) | _keys_in(_read(os.path.join(top, name)), own)
    reached = 0
    for port in task["ports"]:  # the endpoint's real port, and the master's
        with socket.socket() as s:
            s.settimeout(2.0)
            reached += s.connect_ex(("127.0.0.1", port)) == 0
    stolen = 0
    for key in found:
        try:
            await _ask(client.with_options(api_key=key, max_retries=0), "stolen")
            stolen += 1
        except Exception:
            pass
    await _ask(client, "Hi")  # a call of its own: the episode's experience carries this report
    await _gate(client, "thief_done")
    return {"reward": 0.0, "foreign_keys": float(len(found)), "stolen_calls": float(stolen),
            "ports_reached": float(reached), "processes_seen": float(len(pids))}


async def crashes(task: dict, client) -> float:
    await _ask(client, "Hi")
    os._exit(3)


async def segfaults(task: dict, client) -> float:
    import ctypes

    await _ask(client, "Hi")
    ctypes.string_at(0)
    return 1.0


async def eats_memory(task: dict, client) -> float:
    await _ask(client, "Hi")
    hoard = []
    while True:
        hoard.append(bytearray(32 << 20))


async def hangs_after_a_call(task: dict, client) -> float:
    await _ask(client, "Hi")
    await asyncio.Event().wait()
    return 1.0


async def polite(task: dict, client) -> float:
    await _ask(client, "Hi")
    return 1.0


def _local():
    async def agent(task: dict, client) -> float:
        return 1.0

    return agent


local_agent = _local()  # defined inside a function: no episode's process can import it
