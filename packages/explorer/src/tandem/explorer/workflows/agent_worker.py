"""The program that plays one agent episode inside the sandbox (`agent_sandbox`).

`tandem.common.sandbox_runner` runs it as the candidate: under the slot's uid, with the
sandbox's resource limits, after `python -I -S`. It reads one JSON line on stdin (the agent's
import path, "module:function", the task payload, the episode's key, the endpoint's socket, the
client's timeout, retries and CPU seconds, and the line that says the agent starts), serves the
endpoint on a loopback port of the sandbox's own network namespace (forwarding each connection
to the unix socket the explorer bound in), lowers its CPU limit to what it spent so far plus
its CPU seconds, writes that start line to the sandbox's stdout (the episode's timeout and CPU
count from there, not from the interpreter's start), calls the agent with an
`openai.AsyncOpenAI` client on that URL and key, and writes one JSON line: {"result": ...},
{"raised": "Type: message"} or {"garbage": "..."}.

The agent's own prints go to stderr: stdout carries only that line. Standard library and the
`openai` client only; nothing of tandem is imported here.
"""

import asyncio
import importlib
import json
import os
import resource
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy `reader` to `writer` until EOF (both ends of a forwarded connection use it: here
    and in the explorer's bridge, `agent_sandbox`)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def _forward(socket_path: str, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def _load(spec: str):
    module, _, name = spec.partition(":")
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def _write(out: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(out, view):]


def _budget_cpu(seconds: float) -> None:
    """Lower this process's CPU limit to what it has spent so far (the interpreter, the
    imports) plus `seconds`: the episode's CPU, like its wall clock, counts from the call."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1 if hard == resource.RLIM_INFINITY
                                              else min(soft + 1, hard)))


def _reply(out: int, message: dict) -> None:
    _write(out, json.dumps(message).encode() + b"\n")


async def _play(spec: dict, out: int) -> None:
    import openai

    fn = _load(spec["fn"])
    server = await asyncio.start_server(
        lambda r, w: _forward(spec["socket"], r, w), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    # for agents that build their own client from the environment
    os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = url, spec["key"]
    client = openai.AsyncOpenAI(base_url=url, api_key=spec["key"],
                                max_retries=spec["max_retries"], timeout=spec["timeout"])
    _budget_cpu(spec["cpu_seconds"])
    _write(out, spec["started"].encode())
    try:
        result = await fn(spec["task"], client)
    except MemoryError:
        raise  # the runner's exit code says `memory`
    except Exception as exc:
        _reply(out, {"raised": f"{type(exc).__name__}: {str(exc)[:200]}"})
        return
    finally:
        await client.close()
        server.close()
    try:
        _reply(out, {"result": result})
    except (TypeError, ValueError):
        _reply(out, {"garbage": f"{type(result).__name__} {str(result)[:80]!r}"})


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    sys.path[:] = spec["path"]
    out = os.dup(1)
    os.dup2(2, 1)  # the agent's prints land in stderr; `out` carries the one reply
    sys.stdout = sys.stderr
    asyncio.run(_play(spec, out))


if __name__ == "__main__":
    main()
