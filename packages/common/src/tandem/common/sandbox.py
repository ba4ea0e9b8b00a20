"""Run one untrusted program once, inside limits, and say how it ended.

Shared by the reward's `code` function (`reward.code`) and the explorer's `agent` workflow
(`workflow_args.sandbox`), which runs each agent episode here (docs/explorer.md#agent).

Isolation is bubblewrap (`bwrap`, Debian package `bubblewrap`), a maintained tool that builds
the namespaces; each run gets:
- a filesystem namespace whose root is an empty tmpfs holding only the Python runtime
  (read-only), the runner, the program, and its own scratch directory `/work` (writable, also
  HOME), plus the caller's `readable` paths (read-only) and a run's own `binds`; no host path
  beyond those, so no dataset, no other run's files, no host unix socket it was not given;
- fresh PID (with its own `/proc`), network (loopback only), IPC (no host System V objects) and
  UTS namespaces; a fresh tmpfs on /tmp (also /var/tmp and /dev/shm) that vanishes with the run;
- when the scorer runs as root, the candidate under its own uid per slot (claimed host-wide
  from `reward.code.uid_base` up: `SlotUids`) and, in assert mode, the test harness under a
  second one, so the candidate cannot signal, trace or read the harness, and `RLIMIT_NPROC`
  counts only it;
- resource limits (CPU seconds, address space per process, processes, file size, open files),
  and, where a cgroup memory controller is writable, a memory limit for the whole run (every
  process the candidate forks shares one budget, tmpfs files included);
- a wall-clock limit after which the whole tree is killed.

Output is read up to `max_output_bytes`; grading happens in the caller, outside the sandbox.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from tandem.common.config.reward import CodeSandboxConfig
from tandem.common.errors import TandemError

from . import sandbox_runner
from .spawn import proc_stats, spawn

log = structlog.get_logger(__name__)

_RESERVED = {
    sandbox_runner.RUNTIME_ERROR: "runtime_error",
    sandbox_runner.MEMORY_ERROR: "memory",
    sandbox_runner.SYNTAX_ERROR: "syntax_error",
    sandbox_runner.FILE_TOO_LARGE: "file_size",
    sandbox_runner.NOT_REACHED: "not_reached",
}
# seconds a killed run's processes get to exit before the sandbox goes on and says which remain
KILL_WAIT = 5.0
# The first line a program run with `start_seconds` writes to stdout once its own work begins
# (its interpreter started, its imports done): its wall clock counts from there.
STARTED = b"#tandem-sandbox: started\n"


def install_hint(key: str) -> str:
    return ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf "
            f"install bubblewrap) or set {key}.isolation to none for trusted code only")


# Joins the cgroups named before `--`, then becomes the command after it, so that nothing of
# the run ever executes outside its memory and process budget.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(slots=True)
class Run:
    """How one run ended. `status`: ok, exit (nonzero code), runtime_error, memory,
    syntax_error, file_size, not_reached (assert mode: the test could not finish), cpu,
    signal, timeout (wall clock), start_timeout (no `STARTED` line within `start_seconds`)
    or output_limit."""

    status: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    seconds: float

    @property
    def detail(self) -> str:
        """The last line of stderr, which usually names the exception."""
        lines = [ln for ln in self.stderr.decode(errors="replace").strip().splitlines()
                 if ln.strip() and not ln.startswith("bwrap: ")]
        return lines[-1][:200] if lines else ""


def _status(code: int) -> str:
    if code == 0:
        return "ok"
    if code in _RESERVED:
        return _RESERVED[code]
    if code > 128 or code < 0:  # the runner's 128 + signal, or the launcher's own signal
        sig = code - 128 if code > 128 else -code
        return "cpu" if sig in (signal.SIGXCPU, signal.SIGKILL) else "signal"
    return "exit"


UID_LOCKS = Path("/run" if os.path.isdir("/run") else "/tmp") / "tandem-sandbox-uids"
UID_SPAN = 4096  # how far past uid_base a sandbox looks for uids no other sandbox holds


def _uid_in_use(uid: int) -> bool:
    """A uid some process still runs as (a sandbox's leftover after a kill that gave up, or a
    scorer killed unisolated), or one that names a user: never handed to a candidate."""
    if uid >= 65534:  # nobody, and (uid_t)-1 of 16-bit tools
        return True
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    return True
            except OSError:
                pass  # exited meanwhile
    return False


def _lock_dir() -> Path:
    """UID_LOCKS, root's own: made 0700, refused when it is a link or anyone else's (a world-
    writable /tmp must not let another user plant a lock file or a symlink for root to open)."""
    try:
        UID_LOCKS.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(UID_LOCKS)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
        raise TandemError(f"{UID_LOCKS}: not a directory of root's own (mode 0700), so the "
                          "sandbox cannot claim its uids there; remove it")
    return UID_LOCKS


class SlotUids:
    """The uids this sandbox's slots run under, claimed host-wide for as long as it lives.

    `RLIMIT_NPROC` counts every process of a uid on the host, so two sandboxes (two reward
    services, two test workers, a run and its evaluation) whose slots shared `uid_base + k`
    shared one process limit: a fork bomb in one made the other's candidate fail to fork, and a
    correct program scored 0. Each uid is claimed with an exclusive `flock` on a file in a
    directory of root's own, held until `release` or this process's death; the search goes on
    past a uid another sandbox holds or some process still runs as."""

    def __init__(self, base: int, count: int, key: str):
        self.uids: list[int] = []
        self._files: list[int] = []
        try:
            folder = _lock_dir()
            uid = base
            while len(self.uids) < count:
                if uid >= base + UID_SPAN:
                    raise TandemError(f"{key}.uid_base: no {count} free uids in {base}.."
                                      f"{base + UID_SPAN - 1} (other sandboxes hold them)")
                if not _uid_in_use(uid):
                    self._claim(folder / f"{uid}.lock", uid)
                uid += 1
        except BaseException:
            self.release()
            raise

    def _claim(self, path: Path, uid: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # another sandbox's
            return
        except BaseException:
            os.close(fd)
            raise
        self.uids.append(uid)
        self._files.append(fd)
        if _uid_in_use(uid):  # a process took it between the look and the lock
            self.uids.pop()
            os.close(self._files.pop())

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)  # closing the last descriptor drops the lock
        self._files, self.uids = [], []


class Cgroups:
    """One memory cgroup per sandbox slot, when this process may create them (cgroup v2 with
    the memory controller, or the v1 memory hierarchy). Processes stay counted by
    RLIMIT_NPROC under the slot's uid: a pids cgroup keeps the charges of exited tasks a while
    after a PID namespace ends, so back-to-back runs would find it full."""

    def __init__(self, memory_bytes: int, slots: int):
        self.memory_bytes, self.slots = memory_bytes, slots
        self.dirs: dict[str, Path] = {}   # controller -> our folder ("unified" for v2)
        self.version = 0
        self.error = ""

    def _own(self, controller: str) -> str:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            if (controller == "" and names == "") or controller in names.split(","):
                return path
        raise OSError(f"no {controller or 'unified'} cgroup in /proc/self/cgroup")

    def start(self) -> bool:
        tag = f"tandem-sandbox-{os.getpid()}-{secrets.token_hex(3)}"
        root = Path("/sys/fs/cgroup")
        try:
            if "memory" in (root / "cgroup.controllers").read_text().split() if (
                    root / "cgroup.controllers").exists() else False:
                # v2: a leaf may not hold processes and children, so our folder sits beside us
                parent = root / self._own("").lstrip("/")
                base = parent.parent / tag if parent != root else root / tag
                base.mkdir()
                self.dirs["unified"] = base
                (base / "cgroup.subtree_control").write_text("+memory")
                self.version = 2
            else:
                base = root / "memory" / self._own("memory").lstrip("/") / tag
                base.mkdir()
                self.dirs["memory"] = base
                self.version = 1
            for slot in range(self.slots):
                self._make(slot)
            for base in self.dirs.values():
                _sweep(base.parent)
            return True
        except (OSError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.close()
            return False

    def _make(self, slot: int) -> None:
        if self.version == 2:
            d = self.dirs["unified"] / f"slot{slot}"
            d.mkdir()
            (d / "memory.max").write_text(str(self.memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            return
        mem = self.dirs["memory"] / f"slot{slot}"
        mem.mkdir()
        (mem / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            try:
                (mem / "memory.memsw.limit_in_bytes").write_text(str(self.memory_bytes))
            except OSError:
                pass  # swap accounting off: nothing to limit

    def procs_files(self, slot: int) -> list[str]:
        return [str(d / f"slot{slot}" / "cgroup.procs") for d in self.dirs.values()]

    def oom_kills(self, slot: int) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        d = self.dirs["unified" if self.version == 2 else "memory"] / f"slot{slot}"
        try:
            for line in (d / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def pids(self, slot: int) -> set[int]:
        """The processes in the slot's cgroups."""
        found: set[int] = set()
        for path in self.procs_files(slot):
            try:
                found.update(int(p) for p in Path(path).read_text().split())
            except OSError:
                continue
        return found

    def kill_all(self, slot: int) -> None:
        """SIGKILL whatever is still in the slot's cgroup (nothing may outlive a run)."""
        for pid in self.pids(slot):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def close(self) -> None:
        for base in self.dirs.values():
            for slot in range(self.slots):
                for _ in range(50):
                    try:
                        (base / f"slot{slot}").rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        self.kill_all(slot)
                        time.sleep(0.02)
            try:
                base.rmdir()
            except OSError:
                pass
        self.dirs.clear()


def _sweep(parent: Path) -> None:
    """Remove the empty cgroup folders of sandboxes whose process is gone (killed with
    SIGKILL, it could not remove them); the folder name carries the pid."""
    for old in parent.glob("tandem-sandbox-*-*"):
        try:
            pid = int(old.name.split("-")[2])
            os.kill(pid, 0)
            continue  # still running
        except (ValueError, IndexError):
            continue
        except PermissionError:
            continue
        except ProcessLookupError:
            pass
        try:
            for slot in old.glob("slot*"):
                slot.rmdir()
            old.rmdir()
        except OSError:
            pass  # not empty yet: a later start tries again


def _outermost(paths: list[str]) -> list[str]:
    """`paths` made absolute, without those inside another one (binding both would ask
    bubblewrap to make folders inside a read-only mount), sorted; never `/` itself."""
    out: list[str] = []
    for path in sorted({os.path.abspath(p) for p in paths} - {"/"}):
        if not out or not path.startswith(out[-1].rstrip("/") + "/"):
            out.append(path)
    return out


def _runtime(python: str, key: str) -> tuple[str, list[str]]:
    """(the real interpreter, the host folders it needs) for `python`."""
    probe = subprocess.run(
        [python, "-I", "-S", "-c",
         "import sys,os; print(os.path.realpath(sys._base_executable if hasattr(sys, "
         "'_base_executable') else sys.executable)); print(sys.base_prefix)"],
        capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        raise TandemError(f"{key}.python {python!r} does not run: "
                          f"{probe.stderr.strip()[-200:]}")
    executable, prefix = probe.stdout.split("\n")[:2]
    paths = [prefix]
    if not executable.startswith(prefix.rstrip("/") + "/"):
        paths.append(os.path.dirname(executable))
    for lib in ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib32", "/lib32"):
        if os.path.isdir(lib) and not os.path.islink(lib):
            paths.append(lib)
    return executable, paths


class Sandbox:
    """`start()` once (finds bwrap, probes it, makes the cgroups), then `run()` concurrently.

    `readable`: host paths every run sees read-only at the same place (an agent's imports);
    `key`: the config section named in errors and logs."""

    def __init__(self, config: CodeSandboxConfig, *, slots: int, readable: tuple[str, ...] = (),
                 key: str = "reward.code"):
        self.config = config
        self.slots = slots
        self.readable = readable
        self.key = key
        self.python = config.python or sys.executable
        self.isolated = config.isolation != "none"
        self.as_root = os.geteuid() == 0
        self.cgroups: Cgroups | None = None
        self._bwrap: str | None = None
        self._root_args: list[str] = []
        self._slot_queue: asyncio.Queue[int] | None = None
        self._base: Path | None = None
        self._runner: Path | None = None
        self._uids: SlotUids | None = None

    async def start(self) -> None:
        if self._base is not None:
            return
        if self.isolated:
            self._bwrap = shutil.which("bwrap")
            if self._bwrap is None:
                raise TandemError(f"{self.key}: the sandbox needs bubblewrap (`bwrap` not "
                                  f"found on PATH); {install_hint(self.key)}")
        self._base = Path(tempfile.mkdtemp(prefix="tandem-sandbox-"))
        self._base.chmod(0o711)
        self._runner = self._base / "runner.py"
        shutil.copyfile(sandbox_runner.__file__, self._runner)
        self._runner.chmod(0o644)
        self._slot_queue = asyncio.Queue()
        for slot in range(self.slots):
            self._slot_queue.put_nowait(slot)
        try:
            if self.as_root:  # a candidate's and, in assert mode, a harness's uid per slot
                self._uids = SlotUids(self.config.uid_base, 2 * self.slots, self.key)
            if self.isolated:
                await asyncio.to_thread(self._prepare)
        except BaseException:
            await self.close()
            raise
        log.info("sandbox.ready", key=self.key, isolation="bubblewrap" if self.isolated else "none",
                 per_slot_uid=self.as_root, slots=self.slots, python=self.python,
                 memory=f"cgroup v{self.cgroups.version}, per run" if self.cgroups
                 else "RLIMIT_AS, per process")
        if not self.isolated:
            log.warning("sandbox.unisolated", key=f"{self.key}.isolation",
                        consequence="candidates see the host filesystem, network and processes;"
                                    " for trusted code only")

    def _prepare(self) -> None:
        executable, paths = _runtime(self.python, self.key)
        self.python = executable
        args: list[str] = []
        made = {"/"}
        for path in _outermost(paths + [p for p in self.readable if os.path.exists(p)]):
            parts = Path(path).parts
            for i in range(2, len(parts)):
                parent = str(Path(*parts[:i]))
                if parent not in made:
                    args += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            args += ["--ro-bind", path, path]
        for lib in ("/lib", "/lib64", "/lib32", "/bin"):
            if os.path.islink(lib):
                args += ["--symlink", os.readlink(lib), lib]
        if os.path.exists("/etc/ld.so.cache"):
            args += ["--perms", "0755", "--dir", "/etc",
                     "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        self._root_args = args
        cfg = self.config
        if self.as_root:
            cgroups = Cgroups(cfg.memory_mb << 20, self.slots)
            if cgroups.start():
                self.cgroups = cgroups
            else:
                log.warning("sandbox.memory_per_process", reason=cgroups.error,
                            consequence="memory is limited per process (RLIMIT_AS), not per run")
        done = subprocess.run(self._command(0, "stdio", self._base / "probe", probe=True),
                              capture_output=True, timeout=30, input=b"")
        if done.returncode != 0:
            self.close_sync()
            raise TandemError(
                f"{self.key}: bubblewrap cannot build the sandbox here (it needs root or "
                "unprivileged user namespaces): "
                f"{done.stderr.decode(errors='replace').strip()[-300:] or done.returncode}; "
                f"{install_hint(self.key)}")

    def slot_uids(self, slot: int) -> tuple[int, int]:
        """The candidate's and the harness's uid for `slot`: claimed ones as root, else ours."""
        if not self.as_root:
            return os.getuid(), os.getuid()
        if self._uids is None:  # fail closed: as root, never a candidate under our own uid
            raise TandemError(f"{self.key}: the sandbox is closed (or not started)")
        return self._uids.uids[slot], self._uids.uids[self.slots + slot]

    def _command(self, slot: int, mode: str, run_dir: Path, *, probe: bool = False,
                 binds: tuple[tuple[str, str], ...] = ()) -> list[str]:
        cfg = self.config
        # As root the candidate never keeps root, isolated or not (without isolation, modules
        # it imports must then be readable by the slot uid).
        uid, harness_uid = self.slot_uids(slot)
        runner_args = [mode, str(cfg.cpu_seconds), str(cfg.memory_mb << 20), str(cfg.nproc),
                       str(int(cfg.file_size_mb * (1 << 20))), str(cfg.open_files), str(uid),
                       str(harness_uid)]
        if not self.isolated:
            return [self.python, "-I", "-S", str(self._runner), *runner_args]
        tmp_size = str(cfg.memory_mb << 20)
        cmd = [self._bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
               "--die-with-parent", "--new-session"]
        if self.as_root:
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            cmd += ["--unshare-user"]
        # /dev: the few character devices programs use, not bubblewrap's full --dev (devpts,
        # ptmx, console links), which costs several mounts per run
        cmd += ["--proc", "/proc", "--perms", "0755", "--dir", "/dev"]
        for dev in ("null", "zero", "full", "random", "urandom"):
            cmd += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
        cmd += ["--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "/proc/self/fd/0",
                "/dev/stdin", "--symlink", "/proc/self/fd/1", "/dev/stdout",
                "--symlink", "/proc/self/fd/2", "/dev/stderr"]
        # one fresh tmpfs serves /tmp, /var/tmp and /dev/shm (one mount instead of three)
        cmd += ["--perms", "1777", "--size", tmp_size, "--tmpfs", "/tmp",
                "--symlink", "/tmp", "/dev/shm",
                "--perms", "0755", "--dir", "/var", "--symlink", "/tmp", "/var/tmp",
                "--perms", "0755", "--dir", "/sandbox",
                "--ro-bind", str(self._runner), "/sandbox/runner.py"]
        if probe:
            cmd += ["--ro-bind", str(self._runner), "/sandbox/solution.py"]
        else:
            cmd += ["--ro-bind", str(run_dir / "solution.py"), "/sandbox/solution.py",
                    "--bind", str(run_dir / "work"), "/work"]
            for host, inside in binds:
                cmd += ["--ro-bind", host, inside]
        # the runtime and the readable paths last, so that one under /tmp or /work (a test's
        # tmp_path, a checkout in /work) is seen, not hidden by the run's own mounts there
        cmd += self._root_args
        cmd += ["--chdir", "/work" if not probe else "/", "--clearenv",
                "--setenv", "PATH", f"{os.path.dirname(self.python)}:/usr/bin:/bin",
                "--setenv", "HOME", "/work", "--setenv", "TMPDIR", "/tmp",
                "--setenv", "LANG", "C.UTF-8", "--setenv", "LC_ALL", "C.UTF-8",
                self.python, "-I", "-S", "/sandbox/runner.py", *runner_args]
        if probe:  # the runner itself, as a program that defines names and exits 0
            cmd = cmd[:-len(runner_args) - 1] + ["-c", "pass"]
        if self.cgroups is not None:
            cmd = ["/bin/sh", "-c", _JOIN, "sh", *self.cgroups.procs_files(slot), "--", *cmd]
        return cmd

    async def run(self, program: str, *, stdin: bytes = b"", test: str | None = None,
                  setup: str = "", wall_seconds: float | None = None,
                  start_seconds: float | None = None,
                  binds: tuple[tuple[str, str], ...] = ()) -> Run:
        """Run `program` (stdio mode), or `program` against `test` (assert mode, `setup` run
        before both); the wall clock is `code.wall_seconds`, or `wall_seconds` if shorter.
        `start_seconds`: the program says when its own work begins by writing `STARTED` first
        on stdout (dropped from `Run.stdout`), and its wall clock counts from there; until
        then, a launch that a loaded machine slows down (bubblewrap, the interpreter, the
        program's imports) is bounded by `start_seconds` alone.
        `binds`: (host path, path inside) pairs this run alone sees, read-only (a unix socket
        stays connectable)."""
        if self._slot_queue is None:
            await self.start()
        slot = await self._slot_queue.get()
        run_dir = self._base / f"run-{secrets.token_hex(8)}"
        try:
            if test is not None:
                head = setup.encode()
                stdin = b"%010d" % len(head) + head + test.encode()
            return await self._run(slot, run_dir, program, stdin, test, wall_seconds,
                                   start_seconds, binds)
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, run_dir, True))
            self._slot_queue.put_nowait(slot)

    async def _run(self, slot: int, run_dir: Path, program: str, stdin: bytes,
                   test: str | None, wall_seconds: float | None,
                   start_seconds: float | None, binds: tuple[tuple[str, str], ...]) -> Run:
        cfg = self.config
        work = run_dir / "work"
        work.mkdir(parents=True)
        run_dir.chmod(0o711)
        (run_dir / "solution.py").write_text(program, encoding="utf-8")
        (run_dir / "solution.py").chmod(0o644)
        if self.as_root:
            uid = self.slot_uids(slot)[0]
            os.chown(work, uid, uid)
        work.chmod(0o700)
        mode = "stdio"
        if test is not None:
            mode = "assert"
        if not self.isolated:
            shutil.copyfile(run_dir / "solution.py", work / "solution.py")
        cmd = self._command(slot, mode, run_dir, binds=binds)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        if not self.isolated:
            env["SANDBOX_PROGRAM"] = str(work / "solution.py")
        wall = cfg.wall_seconds if wall_seconds is None else min(cfg.wall_seconds, wall_seconds)
        oom_before = self.cgroups.oom_kills(slot) if self.cgroups else 0
        start = time.monotonic()
        proc = await spawn(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=str(work), env=env, start_new_session=True,
            on_cancel=lambda started: self._kill(started, slot))
        out, err = bytearray(), bytearray()
        over = asyncio.Event()
        started = asyncio.Event() if start_seconds is not None else None
        readers = [asyncio.create_task(self._read(proc.stdout, out, over, started)),
                   asyncio.create_task(self._read(proc.stderr, err, over))]
        feeder = asyncio.create_task(self._feed(proc, stdin))
        waiter = asyncio.create_task(proc.wait())
        limit = asyncio.create_task(over.wait())
        began = asyncio.create_task(started.wait()) if started is not None else None
        status = None
        try:
            if began is not None:
                done, _ = await asyncio.wait({waiter, limit, began}, timeout=start_seconds,
                                             return_when=asyncio.FIRST_COMPLETED)
                if limit in done:
                    status = "output_limit"
                elif not done:
                    status = "start_timeout"
            if status is None and not waiter.done():
                done, _ = await asyncio.wait({waiter, limit}, timeout=max(wall, 0.0),
                                             return_when=asyncio.FIRST_COMPLETED)
                if limit in done:
                    status = "output_limit"
                elif not done:
                    status = "timeout"
        finally:
            # Also on cancellation (the evaluation's own deadline): nothing may outlive the run.
            for task in (feeder, limit, began):
                if task is not None:
                    task.cancel()
            await self._kill(proc, slot)
            waiter.cancel()
            await self._drain(proc, readers)
        code = proc.returncode
        if status is None:
            status = _status(code)
            if status in ("cpu", "signal", "runtime_error") and self.cgroups is not None \
                    and self.cgroups.oom_kills(slot) > oom_before:
                status = "memory"  # the run's memory budget was spent; the kernel killed it
        return Run(status, code, bytes(out), bytes(err), time.monotonic() - start)

    @staticmethod
    async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
        try:
            if data:
                proc.stdin.write(data)
                await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the candidate did not read its input; its output says what it did

    async def _read(self, stream: asyncio.StreamReader, into: bytearray,
                    over: asyncio.Event, started: asyncio.Event | None = None) -> None:
        """Read to EOF, keeping at most max_output_bytes; more sets `over` (the run is killed)
        and is read and dropped, so the pipe drains and the process can be reaped. With
        `started`, a leading `STARTED` line sets it and is dropped."""
        cap = self.config.max_output_bytes
        head = bytearray() if started is not None else None
        while (chunk := await stream.read(65536)) or head:
            if head is not None:
                head += chunk
                if chunk and len(head) < len(STARTED) and STARTED.startswith(head):
                    continue  # the marker may arrive in pieces
                if head.startswith(STARTED):
                    started.set()
                    del head[:len(STARTED)]
                chunk, head = bytes(head), None
            if len(into) < cap:
                into += chunk[:cap - len(into)]
            elif not over.is_set():
                over.set()

    @staticmethod
    async def _drain(proc: asyncio.subprocess.Process, readers: list[asyncio.Task]) -> None:
        """Wait for the readers to see EOF; a writer that escaped the kill cannot hold us."""
        _, pending = await asyncio.wait(readers, timeout=1.0)
        if pending:
            for task in pending:
                task.cancel()
            proc._transport.close()  # no public way to drop a pipe a stray process holds open
            log.warning("sandbox.stray_writer", pid=proc.pid)
        await asyncio.gather(*readers, return_exceptions=True)

    async def _kill(self, proc: asyncio.subprocess.Process, slot: int) -> None:
        """Kill the tree: the namespace's first process (the kernel then kills the rest),
        bubblewrap, the process group, and whatever is still in the slot's cgroup; return once
        every process of the tree seen before the kill, and of the slot's cgroup, has exited (a
        SIGKILLed process takes a moment to go, longer on a loaded machine; one bubblewrap
        started after the look at the tree is in the cgroup), at most KILL_WAIT seconds."""
        tree = _tree(proc.pid)
        if proc.returncode is None:
            for pid in _children(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        await proc.wait()
        if self.cgroups is not None:
            self.cgroups.kill_all(slot)
        deadline = time.monotonic() + KILL_WAIT
        while (alive := self._left(tree, proc.pid, slot)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if alive:
            log.warning("sandbox.slow_exit", pids=alive, seconds=KILL_WAIT)

    def _left(self, tree: list[int], session: int, slot: int) -> list[int]:
        """What still runs of a killed run: its tree as seen before the kill, bubblewrap's
        session (a child it was forking at the kill), its cgroup (what runs inside)."""
        pids = set(tree) | _session(session)
        if self.cgroups is not None:
            pids |= self.cgroups.pids(slot)
        return sorted(pid for pid in pids if _alive(pid))

    def close_sync(self) -> None:
        if self.cgroups is not None:
            self.cgroups.close()
            self.cgroups = None
        if self._uids is not None:
            self._uids.release()
            self._uids = None

    async def close(self) -> None:
        if self.cgroups is not None or self._uids is not None:
            await asyncio.to_thread(self.close_sync)
        if self._base is not None:
            await asyncio.to_thread(shutil.rmtree, self._base, True)
            self._base = None
        self._slot_queue = None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _tree(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    found, frontier = [], [pid]
    while frontier:
        below = _children(frontier.pop())
        found += below
        frontier += below
    return found


def _session(sid: int) -> set[int]:
    """The processes of session `sid`."""
    return {pid for pid, fields in proc_stats() if int(fields[3]) == sid}


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has exited: only its parent's wait is left)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
