"""The first process inside a code sandbox; standard library only, started as `python -I -S`.

It starts as root inside the sandbox (a fresh mount, PID, network, IPC and UTS namespace that
bubblewrap built, seeing only the Python runtime, this file, the program and its scratch
directory), forks the candidate under the slot's uid with its resource limits, waits, and
exits with how it ended (128 + signal when a signal ended it). It never runs candidate code
itself and never grades stdout: the scorer outside does.

Usage: sandbox_runner.py MODE CPU_S AS_BYTES NPROC FSIZE_BYTES NOFILE UID HARNESS_UID

- `stdio`: the candidate (/sandbox/solution.py) reads stdin and writes stdout; the scorer
  compares that output, outside.
- `assert`: the test code arrives on stdin and never reaches the candidate. The runner first
  forks the candidate as a server of its names (stdin /dev/null, stdout and stderr both the
  sandbox's stderr), then reads the test code and forks a *harness* under another uid that runs
  it; every name the program defined is a proxy there, and each call crosses a pipe as plain
  data (None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset; exact
  types only). So a candidate that patches `exec`, returns an object equal to everything or
  looks for the expected values finds nothing to act on: the comparisons, and the verdict,
  happen in the harness, whose exit status alone is the runner's. The candidate holds neither
  the sandbox's stdout nor a way to signal or trace a process of another uid.
"""

import errno
import os
import resource
import sys

RUNTIME_ERROR, MEMORY_ERROR, SYNTAX_ERROR, FILE_TOO_LARGE, NOT_REACHED = 101, 102, 103, 104, 105
PROGRAM = os.environ.get("SANDBOX_PROGRAM", "/sandbox/solution.py")  # set only without isolation
MAX_MESSAGE = 64 << 20  # one reply across the harness pipe
MAX_DEPTH = 100


def _print_exc(**kwargs) -> None:
    import traceback  # only on failure: importing it costs more than starting the interpreter

    traceback.print_exc(**kwargs)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _limit(cpu_s: int, mem: int, nproc: int, fsize: int, nofile: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _become(uid: int) -> None:
    """Drop root for `uid` (no-op when the runner is not root, e.g. in a user namespace)."""
    if os.getuid() == 0 and uid != 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _fork(body, keep: tuple) -> int:
    """Fork a child running `body()`, its exit code capped to 0..255; `keep` lists the fds
    it may hold besides 0, 1, 2."""
    pid = os.fork()
    if pid == 0:
        code = RUNTIME_ERROR
        try:
            for fd in range(3, 256):
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            code = body()
        except BaseException:
            _print_exc()
        finally:
            _flush()
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)
    return pid


def _wait(pid: int) -> int:
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class _Exited(Exception):
    """The candidate called sys.exit while loading (assert mode)."""


def _run_guarded(run) -> int:
    """Run `run()` and turn how it ended into the runner's exit codes."""
    try:
        run()
    except _Exited:
        return NOT_REACHED
    except SystemExit as exc:
        _flush()
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except MemoryError:
        os.write(2, b"MemoryError\n")
        return MEMORY_ERROR
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            os.write(2, b"File too large\n")
            return FILE_TOO_LARGE
        _print_exc()
        return RUNTIME_ERROR
    except BaseException:
        try:
            _print_exc()
        except MemoryError:
            os.write(2, b"MemoryError\n")
            return MEMORY_ERROR
        return RUNTIME_ERROR
    _flush()
    return 0


def _compile(source: str, name: str):
    try:
        return compile(source, name, "exec")
    except (SyntaxError, ValueError):
        _print_exc(limit=0)
        return None


# -- stdio -----------------------------------------------------------------------------------

def stdio_candidate() -> int:
    with open(PROGRAM, encoding="utf-8") as f:
        code = _compile(f.read(), "solution.py")
    if code is None:
        return SYNTAX_ERROR
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    return _run_guarded(lambda: exec(code, scope))


# -- plain data across the harness pipe ------------------------------------------------------

class Unsupported(TypeError):
    pass


def encode(value, depth: int = 0):
    """Plain data to JSON-able tagged form; exact types only (no subclasses)."""
    if depth > MAX_DEPTH:
        raise Unsupported("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -(1 << 53) < value < (1 << 53) else ["I", str(value)]
    if t is float:
        return ["f", value.hex()]
    if t is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if t is bytes:
        return ["b", value.hex()]
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "L", tuple: "T", set: "S", frozenset: "F"}[t]
        return [tag, [encode(v, depth + 1) for v in value]]
    if t is dict:
        return ["D", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise Unsupported(f"{t.__name__} is not plain data")


def decode(data, depth: int = 0):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if data is None or type(data) in (bool, str, int):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"malformed value {str(data)[:60]}")
    tag = data[0]
    if tag == "I":
        return int(data[1])
    if tag == "f":
        return float.fromhex(data[1])
    if tag == "c":
        return complex(float.fromhex(data[1]), float.fromhex(data[2]))
    if tag == "b":
        return bytes.fromhex(data[1])
    if tag in ("L", "T", "S", "F"):
        items = [decode(v, depth + 1) for v in data[1]]
        return {"L": list, "T": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "D":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in data[1]}
    if tag == "H":
        return Handle(int(data[1]))
    raise ValueError(f"unknown tag {tag!r}")


def _send(fd: int, obj) -> None:
    import json  # assert mode only: stdio runs need not pay for importing it

    data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Lines:
    def __init__(self, fd: int):
        self.fd, self.buf = fd, bytearray()

    def read(self):
        import json

        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[:end + 1]
                return json.loads(line)
            if len(self.buf) > MAX_MESSAGE:
                raise ValueError("reply too large")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk


# -- assert: the candidate side --------------------------------------------------------------

def serve_candidate(setup: str, requests: int, replies: int) -> int:
    """Run the setup code (the dataset's imports) and the program, then answer the harness:
    names, calls, attributes, items."""
    import json  # noqa: F401  (imported before the program runs: it may patch the import machinery)

    with open(PROGRAM, encoding="utf-8") as f:
        code = _compile(f.read(), "solution.py")
    before = _compile(setup, "setup.py")
    if code is None or before is None:
        _send(replies, {"fail": "syntax_error"})
        return SYNTAX_ERROR
    scope = {"__name__": "solution", "__builtins__": __builtins__}
    def load() -> None:
        try:
            exec(before, scope)
            exec(code, scope)
        except SystemExit:
            raise _Exited() from None

    status = _run_guarded(load)
    if status == NOT_REACHED:  # it exited while loading: no test can run
        _send(replies, {"fail": "exited", "code": NOT_REACHED})
        return status
    if status:
        _send(replies, {"fail": "load", "code": status})
        return status
    objects: list = []

    def wire(value):
        try:
            return encode(value)
        except Unsupported:
            objects.append(value)
            return ["H", len(objects) - 1]

    names = {}
    for name, value in list(scope.items()):
        if name.startswith("__"):
            continue
        names[name] = wire(value)
    _send(replies, {"names": names})
    inbox = _Lines(requests)
    while (req := inbox.read()) is not None:
        try:
            target = objects[req["h"]]
            op = req["op"]
            if op == "call":
                args = [decode(a) for a in req["args"]]
                kwargs = {k: decode(v) for k, v in req["kwargs"].items()}
                out = target(*args, **kwargs)
            elif op == "getattr":
                out = getattr(target, req["name"])
            elif op == "getitem":
                out = target[decode(req["key"])]
            elif op == "len":
                out = len(target)
            elif op == "list":
                out = list(target)
            elif op == "str":
                out = str(target)
                if type(out) is not str:
                    raise TypeError("__str__ returned a non-string")
            else:
                raise ValueError(f"unknown operation {op!r}")
            reply = {"ok": wire(out)}
        except SystemExit:
            return NOT_REACHED
        except BaseException as exc:
            kind = type(exc).__name__ if type(exc).__module__ == "builtins" else "Exception"
            try:
                message = str(exc)[:500]
            except BaseException:
                message = ""
            reply = {"raise": kind, "message": message}
        _sflush()
        _send(replies, reply)
    return 0


def _sflush() -> None:
    try:
        sys.stdout.flush()
    except BaseException:
        pass


# -- assert: the harness side ----------------------------------------------------------------

class RemoteError(Exception):
    pass


_CHANNEL = None


class Handle:
    """A candidate object the harness may call or look into, but never compare by value:
    equality is identity, so an object claiming to equal everything equals nothing here."""

    __slots__ = ("_h",)

    def __init__(self, h: int):
        object.__setattr__(self, "_h", h)

    def _ask(self, op: str, **fields):
        return _CHANNEL.ask({"h": self._h, "op": op, **fields})

    def __call__(self, *args, **kwargs):
        return self._ask("call", args=[encode(a) for a in args],
                         kwargs={str(k): encode(v) for k, v in kwargs.items()})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __getitem__(self, key):
        return self._ask("getitem", key=encode(key))

    def __len__(self):
        out = self._ask("len")
        if type(out) is not int:
            raise TypeError("len() of a candidate object is not an int")
        return out

    def __iter__(self):
        out = self._ask("list")
        if type(out) is not list:
            raise TypeError("a candidate object did not iterate to plain data")
        return iter(out)

    def __str__(self):
        return self._ask("str")

    def __repr__(self):
        return f"<candidate object {self._h}>"

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__


class _Channel:
    def __init__(self, requests: int, replies: int):
        self.requests, self.replies = requests, _Lines(replies)

    def first(self):
        return self.replies.read()

    def ask(self, request):
        _send(self.requests, request)
        reply = self.replies.read()
        if reply is None:
            raise SystemExit(NOT_REACHED)  # the candidate exited: the test cannot finish
        if "raise" in reply:
            import builtins

            kind = getattr(builtins, str(reply["raise"]), None)
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = RemoteError
            raise kind(reply.get("message", ""))
        return decode(reply["ok"])


def run_harness(setup: str, test_source: str, requests: int, replies: int) -> int:
    global _CHANNEL
    try:  # not dumpable: a process of the same uid cannot trace it or open its /proc files
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass
    _CHANNEL = _Channel(requests, replies)
    hello = _CHANNEL.first()
    if hello is None:
        return NOT_REACHED
    if "fail" in hello:
        os.write(2, f"the program failed to load ({hello['fail']})\n".encode())
        return SYNTAX_ERROR if hello["fail"] == "syntax_error" else hello.get("code",
                                                                              RUNTIME_ERROR)
    before, code = _compile(setup, "setup.py"), _compile(test_source, "test.py")
    if code is None or before is None:
        return SYNTAX_ERROR
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    status = _run_guarded(lambda: exec(before, scope))
    if status:
        return status
    for name, value in hello["names"].items():
        if name not in scope:  # the setup's own imports stay the harness's own
            scope[name] = decode(value)
    return _run_guarded(lambda: exec(code, scope))


def _read_exact(n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _read_rest() -> bytes:
    data = bytearray()
    while chunk := os.read(0, 1 << 16):
        data += chunk
    return bytes(data)


def assert_mode(limits: tuple, uid: int, harness_uid: int) -> int:
    # stdin: the setup's length (10 digits), the setup, then the test code. Read unbuffered,
    # so the test code is not in this process when the candidate is forked from it.
    setup = _read_exact(int(_read_exact(10) or b"0")).decode("utf-8")
    cand_req_r, cand_req_w = os.pipe()
    rep_r, rep_w = os.pipe()

    def candidate() -> int:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(2, 1)  # its prints land in stderr: the sandbox's stdout is not its to write
        _become(uid)
        _limit(*limits)
        return serve_candidate(setup, cand_req_r, rep_w)

    cand = _fork(candidate, keep=(cand_req_r, rep_w))
    os.close(cand_req_r)
    os.close(rep_w)
    # Only now, in memory the candidate never shared, read the test code.
    test_source = _read_rest().decode("utf-8")

    def harness() -> int:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        _become(harness_uid)
        _limit(*limits)
        return run_harness(setup, test_source, cand_req_w, rep_r)

    harn = _fork(harness, keep=(cand_req_w, rep_r))
    os.close(cand_req_w)
    os.close(rep_r)
    code = _wait(harn)
    try:
        os.kill(cand, 9)
    except OSError:
        pass
    _wait(cand)
    return code


def main() -> None:
    mode, cpu, mem, nproc, fsize, nofile, uid, harness_uid = sys.argv[1:9]
    cpu_s = max(1, -int(-float(cpu) // 1))  # ceil, without importing math
    limits = (cpu_s, int(mem), int(nproc), int(fsize), int(nofile))
    if mode == "assert":
        os._exit(assert_mode(limits, int(uid), int(harness_uid)))

    def candidate() -> int:
        _become(int(uid))
        _limit(*limits)
        return stdio_candidate()

    os._exit(_wait(_fork(candidate, keep=())))


if __name__ == "__main__":
    main()
