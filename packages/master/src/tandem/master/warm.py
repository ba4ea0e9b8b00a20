"""A warm process that outlives one invocation (`tandem warm`): it imports torch, transformers
and `tandem up` once, then forks a whole `tandem up` for each client, so a run's start no longer
waits for those imports (issue 27 item 4).

`tandem up` with `TANDEM_WARM=SOCKET` in its environment is the client: it hands the warm
process its argv, environment, working directory and its stdin, stdout and stderr (SCM_RIGHTS),
and the warm process forks. The fork becomes that `tandem up`, in a session of its own, and
before anything else forks the run's zygote from itself (`zygote.prefork`): the zygote has
nothing left to import, and it stays `tandem up`'s child, so the trainer and the explorers it
forks are `tandem up`'s to supervise exactly as with `up.launch: fork`. The client relays
SIGINT, SIGTERM and SIGHUP to the fork and exits with its exit status (or dies of its signal).
A client that disappears (SIGKILL) closes its socket: the warm process then sends the fork the
SIGTERM a supervisor would have sent.

The warm process refuses (and the client starts cold, saying why on stderr) a client of
another interpreter, one whose environment sets what only an exec applies (`LD_*`,
`PYTHON*`, `MALLOC_*`: `zygote.needs_exec`), and any client once a tandem module it imported
changed on disk since: a fork would run the old code.

The protocol, one JSON line each way on a Unix stream socket:
  client -> warm  {"argv": [...], "env": {...}, "cwd": dir, "executable": path}, with the
                  client's fds 0, 1 and 2 attached
  warm -> client  {"pid": n} or {"refused": "one line"}; then {"exit": code} when the fork
                  exits (a negative code: killed by that signal)
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

import click

from .warm_client import CONNECT_TIMEOUT, default_socket, peer_uid, private_folder
from .zygote import PRELOAD, needs_exec, set_cmdline, unsound

# What a forked `tandem up` runs that the zygote's PRELOAD does not import: the CLI, the
# supervisor and what they import on the way to starting the components.
WARM_PRELOAD = (*PRELOAD, "tandem.master.cli", "tandem.master.up", "tandem.common.cli",
                "tandem.master.taskset")
# Read when torch, transformers or huggingface_hub is imported (cache folders, offline mode):
# a fork would keep the warm process's values, so a client that sets them otherwise starts cold
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_")
ROOM = " " * 4096  # argv padding: a fork's set_cmdline writes its own command over it
MAX_REQUEST = 1 << 22  # bytes of one request (argv and environment); a client past it is dropped


@click.command("warm")
@click.option("--socket", "path", type=click.Path(dir_okay=False),
              help="the Unix socket to listen on [default: one per user and virtualenv; "
                   "TANDEM_WARM=1 names it]")
@click.option("--idle", type=click.FloatRange(min=0), default=3600.0, show_default=True,
              help="exit after this many seconds without a run")
def warm(path: str | None, idle: float) -> None:
    """Keep torch, transformers and tandem up imported; each `tandem up` run with
    TANDEM_WARM=SOCKET forks from this process instead of importing them again."""
    path = path or str(default_socket())
    # exec'd with room in its argv: each fork writes its own command line over it
    os.execv(sys.executable, [sys.executable, "-m", "tandem.master.warm", path, str(idle), ROOM])


# -- the warm process ------------------------------------------------------------------------


def tandem_sources() -> dict[str, float]:
    """path -> mtime of every imported tandem module's source: what a fork would run."""
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and getattr(module, "__name__", "").startswith("tandem."):
            try:
                found[path] = os.stat(path).st_mtime
            except OSError:
                continue
    return found


def changed_source(recorded: dict[str, float]) -> str | None:
    """The first recorded module source whose mtime changed (or that is gone), or None."""
    for path, mtime in recorded.items():
        try:
            if os.stat(path).st_mtime != mtime:
                return path
        except OSError:
            return path
    return None


class WarmServer:
    """The warm process: forks a `tandem up` per request, waits for each, tells its client."""

    def __init__(self, path: Path, idle: float):
        self.path = path
        self.idle = idle
        self.sources: dict[str, float] = {}
        self.refused: str | None = None
        self.runs: dict[int, socket.socket] = {}  # forked pid -> its client's connection
        self.stopping = False
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._pending: dict[socket.socket, bytes] = {}  # a client's request so far
        self._fds: dict[socket.socket, list[int]] = {}

    def preload(self) -> float:
        started = time.monotonic()
        # as the zygote does: numpy's OpenBLAS pool would be a thread, and a fork needs none
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        try:
            for name in WARM_PRELOAD:
                importlib.import_module(name)
        except ImportError as exc:
            self.refused = f"the warm process cannot import {exc.name}"
        self.refused = self.refused or unsound()
        self.sources = tandem_sources()
        return time.monotonic() - started

    def bind(self) -> None:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(CONNECT_TIMEOUT)
        try:
            probe.connect(str(self.path))
        except (FileNotFoundError, ConnectionRefusedError):
            self.path.unlink(missing_ok=True)  # a socket file left by a warm process gone
        else:
            raise RuntimeError(f"a warm process already listens on {self.path}")
        finally:
            probe.close()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)  # only this user may connect
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(old)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)
        self.selector.register(self._wake_r, selectors.EVENT_READ, "signal")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries it to the loop

    def serve(self) -> None:
        """Answer clients until SIGTERM or SIGINT (then stop every run) or `idle` seconds
        without a run; returns in the warm process, never in a fork."""
        quiet_since = time.monotonic()
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    self._on_signals()
                else:
                    self._on_client(key.fileobj)
            self._reap()
            if self.runs:
                quiet_since = time.monotonic()
            elif self.stopping or time.monotonic() - quiet_since > self.idle:
                return

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for conn in list(self._pending):
            self._drop(conn)
        if self.listener is not None:
            self.listener.close()
            self.path.unlink(missing_ok=True)
        self.selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        if self.stopping:
            conn.close()
            return
        if peer_uid(conn) != os.getuid():  # the socket's mode already keeps others out
            conn.close()
            return
        conn.setblocking(False)
        self._pending[conn] = b""
        self._fds[conn] = []
        self.selector.register(conn, selectors.EVENT_READ, "client")

    def _on_signals(self) -> None:
        try:
            got = os.read(self._wake_r, 512)
        except BlockingIOError:
            return
        if {signal.SIGTERM, signal.SIGINT} & set(got) and not self.stopping:
            self.stopping = True
            self.listener.close()
            self.selector.unregister(self.listener)
            self.path.unlink(missing_ok=True)
            self.listener = None
            for pid in self.runs:  # each run stops as its supervisor stops it on SIGTERM
                self._signal(pid, signal.SIGTERM)

    def _on_client(self, conn: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        pid = next((p for p, c in self.runs.items() if c is conn), None)
        if pid is not None:  # a client says nothing once it is answered: it went away
            if not data:
                self._signal(pid, signal.SIGTERM)
                self.selector.unregister(conn)
            for fd in fds:
                os.close(fd)
            return
        self._fds[conn] += fds
        self._pending[conn] += data
        if not data or len(self._pending[conn]) > MAX_REQUEST:
            self._drop(conn)
            return
        if b"\n" not in self._pending[conn]:
            return
        line = self._pending.pop(conn).partition(b"\n")[0]
        received = self._fds.pop(conn)
        try:
            request = json.loads(line)
            why = self._refusal(request, received)
        except (ValueError, TypeError, KeyError) as exc:
            request, why = None, f"a malformed request: {exc}"
        if why:
            self._send(conn, refused=why)
            for fd in received:
                os.close(fd)
            self.selector.unregister(conn)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # the pages of what it imported stay shared (zygote.fork_component)
        pid = os.fork()
        if pid == 0:  # unwinds to main(), which turns this fork into the client's command
            raise _BecomeUp(request, received, conn)
        for fd in received:
            os.close(fd)
        self.runs[pid] = conn
        self._send(conn, pid=pid)

    def _refusal(self, request: dict, fds: list[int]) -> str | None:
        if self.refused:
            return self.refused
        if len(fds) != 3:
            return f"expected stdin, stdout and stderr, got {len(fds)} file descriptors"
        if request["executable"] != sys.executable:
            return (f"the warm process runs {sys.executable}, the client "
                    f"{request['executable']}")
        reason = needs_exec(request["env"])
        if reason:
            return f"{reason} in the client's environment takes effect only at exec"
        env = request["env"]
        for key in sorted(set(env) | set(os.environ)):
            if key.startswith(IMPORT_TIME_PREFIXES) and env.get(key) != os.environ.get(key):
                return (f"{key} in the client's environment differs from the warm process's, "
                        "which read it when it imported torch and transformers")
        changed = changed_source(self.sources)
        if changed:
            return (f"{changed} changed since the warm process imported it; restart "
                    "`tandem warm` to run the new code")
        return None

    def become(self, request: dict, fds: list[int], conn: socket.socket) -> None:
        """Turn this fork into the client's `tandem up`, as its exec would have started it:
        nothing of the warm process's loop stays open in it."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        for other in {conn, *self.runs.values(), *self._pending, *self._fds}:
            other.close()
        if self.listener is not None:
            self.listener.close()
        self.selector.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.setsid()  # its own session, as a shell's job would be: the client relays signals
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8",
                                      line_buffering=os.isatty(1))
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        sys.argv = list(request["argv"])
        set_cmdline(sys.argv)

    def _reap(self) -> None:
        while self.runs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            conn = self.runs.pop(pid, None)
            if conn is not None:
                self._send(conn, exit=os.waitstatus_to_exitcode(status))
                try:
                    self.selector.unregister(conn)
                except (KeyError, ValueError):
                    pass
                conn.close()

    def _signal(self, pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    def _send(self, conn: socket.socket, **message) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(CONNECT_TIMEOUT)
            conn.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass  # the client is gone; its run (if any) was told by the EOF
        finally:
            conn.setblocking(False)

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        for fd in self._fds.pop(conn, []):
            os.close(fd)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


class _BecomeUp(BaseException):
    """Raised in a fresh fork of the warm process, to unwind its loop and run the command:
    the command's SystemExit then ends the interpreter as an exec'd one's would (atexit
    handlers, threads joined, streams flushed)."""

    def __init__(self, request: dict, fds: list[int], conn: socket.socket):
        self.request, self.fds, self.conn = request, fds, conn


def run_cli(argv: list[str]) -> None:
    """Run `tandem ARGV...` in this process (a fork of the warm process); ends in SystemExit.
    A `tandem up` gets its zygote forked from here first, before anything of the run exists
    (no thread, no socket, no event loop); in the zygote, and in each component it forks,
    the SystemExit that ends them comes out of `prefork`."""
    from . import zygote
    from .cli import tandem

    if argv[1:2] == ["up"]:
        zygote.prefork()
    try:
        tandem.main(args=argv[1:], prog_name="tandem")
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    finally:
        zygote.drop_prefork()
    leave(code)


def leave(code) -> None:
    """End the command as the interpreter would (its threads joined, atexit handlers run,
    streams flushed) but without tearing down the modules the warm process imported: with
    torch among them that took a second of each invocation's end on a loaded machine, which
    an exec'd `tandem up`, holding no torch, never spends."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def main(argv: list[str]) -> int:
    """`python -m tandem.master.warm SOCKET IDLE ROOM`: what `tandem warm` execs."""
    path, idle = Path(argv[0]), float(argv[1])
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = private_folder(path.parent)
    if why:  # a socket there could be replaced by someone else's: say so before any import
        print(f"tandem warm: {why}; choose another --socket", file=sys.stderr)
        return 1
    server = WarmServer(path, idle)
    seconds = server.preload()
    try:
        server.bind()
    except RuntimeError as exc:
        print(f"tandem warm: {exc}", file=sys.stderr)
        return 1
    ready = {"ready": round(seconds, 3), "socket": str(path), "pid": os.getpid(),
             "refused": server.refused}
    print(json.dumps(ready), flush=True)
    print(f"tandem warm: ready in {seconds:.1f}s; `export TANDEM_WARM={path}` and each "
          "`tandem up` forks from this process (SIGTERM stops it)", file=sys.stderr, flush=True)
    try:
        server.serve()
    except _BecomeUp as fork:  # in the fork: no clean-up of the warm process's own here
        server.become(fork.request, fork.fds, fork.conn)
        run_cli(fork.request["argv"])
    except BaseException:
        server.close()
        raise
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
