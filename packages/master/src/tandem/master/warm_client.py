"""The client side of `tandem warm` (tandem.master.warm): what a `tandem up` with TANDEM_WARM
set runs before anything else, so it imports nothing heavy and nothing of the CLI (the warm
process imports the CLI, which imports this module).

The protocol is in tandem.master.warm's docstring.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CONNECT_TIMEOUT = 5.0  # seconds to reach a warm process and hear whether it forked


def default_socket() -> Path:
    """The socket of this user's warm process for this interpreter (one per virtualenv)."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"tandem-warm-{os.getuid()}"
    return base / f"{hashlib.sha1(sys.executable.encode()).hexdigest()[:12]}.sock"


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def private_folder(folder: Path) -> str | None:
    """Why `folder` may not hold a warm process's socket (another user owns it, or others may
    write in it and so replace the socket), or None."""
    info = folder.stat()
    if info.st_uid != os.getuid():
        return f"{folder} belongs to uid {info.st_uid}"
    if info.st_mode & 0o022:
        return f"{folder} is writable by others (mode {info.st_mode & 0o777:o})"
    return None


def socket_path(value: str) -> str:
    """TANDEM_WARM's value as a socket path: `1` names `default_socket()`."""
    return str(default_socket()) if value == "1" else value


def run_warm(path: str, argv: list[str]) -> int | None:
    """Have the warm process at `path` run `argv`; its exit code, or None when there is no
    warm process there or it refused (the reason is on stderr): the caller starts cold."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lines = _Lines(sock)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(path)
        if peer_uid(sock) != os.getuid():  # never hand another user our environment
            raise PermissionError(f"the process listening there runs as uid {peer_uid(sock)}")
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                   "executable": sys.executable}
        data = (json.dumps(request) + "\n").encode()
        try:
            sent = socket.send_fds(sock, [data], [0, 1, 2])
            if sent < len(data):  # a stream socket may take a large environment in parts
                sock.sendall(data[sent:])
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered (a refusal) and closed before all of it was sent: read it
        reply = lines.next(CONNECT_TIMEOUT)
    except OSError as exc:  # TimeoutError too: no answer within CONNECT_TIMEOUT
        sock.close()
        print(f"tandem up: no warm process at {path} ({exc}); starting cold", file=sys.stderr)
        return None
    if reply is None or "pid" not in reply:
        sock.close()
        why = "it closed the connection" if reply is None else reply.get("refused")
        print(f"tandem up: the warm process at {path} refused: {why}; starting cold",
              file=sys.stderr)
        return None
    pid = reply["pid"]

    def relay(sig: int, _frame) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    done = None
    try:
        while done is None:  # as long as the run: it is bounded by its own up.run_timeout
            try:
                done = lines.next(1.0)
            except TimeoutError:
                continue
            if done is None:
                break
    except OSError:
        done = None
    finally:
        sock.close()
    if done is None or "exit" not in done:
        print(f"tandem up: the warm process at {path} went away; the exit status of run "
              f"{pid} is unknown", file=sys.stderr)
        return 1
    code = done["exit"]
    if code < 0:  # killed by a signal: so is the client, as a shell sees an exec'd one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


class _Lines:
    """JSON lines read from a socket, each within a timeout."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.data = b""

    def next(self, timeout: float) -> dict | None:
        """The next line, None at EOF; TimeoutError when none is complete within `timeout`."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout:g}s")
            self.sock.settimeout(left)
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            self.data += chunk
        line, _, self.data = self.data.partition(b"\n")
        return json.loads(line)
