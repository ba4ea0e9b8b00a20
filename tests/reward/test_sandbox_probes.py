"""The code sandbox against programs that try to fake a pass, read what they must not, reach
the host, or leave something behind. Each probe has the score a fair grader gives."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from backstop import BACKSTOP

from tandem.common.config.reward import CodeSandboxConfig, RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward import LocalScorer
from tandem.reward.functions.code_tests import CodeReward

SECRET = 987654321  # the expected value the probes hunt for
ASSERT = {"asserts": [f"assert solve(1) == {SECRET}"]}
STDIO = {"tests": [{"input": "1\n", "output": f"{SECRET}\n"}]}
REPO = Path(__file__).resolve().parents[2]

# A search for SECRET anywhere the candidate can look: its memory, its frames, every file it
# can read, every process it can see. If found, it answers with it.
HUNT = r'''
import gc, os, sys
want = "".join(["%s", "%s"])  # built at run time, so no code constant holds it
def search():
    for obj in gc.get_objects():  # strings are found through the containers holding them
        try:
            values = list(obj.keys()) + list(obj.values()) if type(obj) is dict else obj
            if type(values) not in (list, tuple):
                continue
            for v in values:
                if type(v) in (str, bytes) and v is not want and want in str(v):
                    return True
        except Exception:
            pass
    frame = sys._getframe().f_back
    while frame is not None:
        if want in repr(frame.f_code.co_consts)[:100000]:
            return True
        frame = frame.f_back
    for root, dirs, files in os.walk("/"):
        if root.startswith(("/usr", "/sys", "/root/.pyenv", "/lib")):
            dirs[:] = []
            continue
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    if want.encode() in f.read(1 << 20):
                        return True
            except Exception:
                pass
    return False
FOUND = search()
def solve(x):
    return int(want) if FOUND else None
print(want if FOUND else "nothing")
''' % (str(SECRET)[:4], str(SECRET)[4:])  # noqa: UP031 (code: its braces stay literal)

PROBES = [
    # (name, program, truth, score a fair grader gives)
    ("patches builtins.exec to a no-op",
     "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef solve(x):\n    return 0",
     ASSERT, 0.0),
    ("patches builtins.compile and AssertionError",
     "import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n"
     "builtins.AssertionError = type('Never', (BaseException,), {})\n"
     "def solve(x):\n    return 0", ASSERT, 0.0),
    ("returns an object equal to everything",
     "class Eq:\n    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
     "def solve(x):\n    return Eq()", ASSERT, 0.0),
    ("returns an int subclass equal to everything",
     "class Int(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\n"
     "def solve(x):\n    return Int(0)", ASSERT, 0.0),
    ("exits 0 when first called",
     "import os\ndef solve(x):\n    os._exit(0)", ASSERT, 0.0),
    ("raises SystemExit(0) when called",
     "def solve(x):\n    raise SystemExit(0)", ASSERT, 0.0),
    ("kills its parent and everyone it sees",
     "import os, signal\nfor p in os.listdir('/proc'):\n"
     "    if p.isdigit() and int(p) != os.getpid():\n"
     "        try: os.kill(int(p), signal.SIGKILL)\n        except Exception: pass\n"
     "def solve(x):\n    return 0", ASSERT, 0.0),
    ("prints a fake pass line to stdout",
     "import sys, os\nfor fd in (1, 2, 3, 4, 5):\n    try: os.write(fd, b'ok\\n0\\n')\n"
     "    except OSError: pass\ndef solve(x):\n    return 0", ASSERT, 0.0),
    ("hunts the expected value (assert mode)", HUNT, ASSERT, 0.0),
    ("hunts the expected value (stdio mode)", HUNT, STDIO, 0.0),
    ("an honest assert solution passes", f"def solve(x):\n    return {SECRET} * x", ASSERT, 1.0),
    ("an honest stdio solution passes", f"print({SECRET} * int(input()))", STDIO, 1.0),
    ("reads the repository's files",
     f"import os\nprint('{SECRET}' if os.path.exists({str(REPO)!r}) else 'no repo')",
     STDIO, 0.0),
    ("reads /etc/passwd and the host's home",
     f"import os\nok = os.path.exists('/etc/passwd') or os.path.exists('/home')\n"
     f"print('{SECRET}' if ok else 'none')", STDIO, 0.0),
    ("sees host processes in /proc",
     f"import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
     f"print('{SECRET}' if len(pids) > 3 else len(pids))", STDIO, 0.0),
    ("writes outside its scratch directory",
     "hit = []\nfor path in ('/sandbox/solution.py', '/usr/lib/x', '/x', '/proc/x', '/etc/x'):\n"
     "    try:\n        open(path, 'a').write('x')\n        hit.append(path)\n"
     f"    except OSError:\n        pass\nprint('{SECRET}' if hit else 'read-only')", STDIO, 0.0),
    ("becomes root again",
     f"import os\ntry:\n    os.setuid(0)\n    print('{SECRET}')\nexcept OSError:\n    print('no')",
     STDIO, 0.0),
    ("opens a raw socket",
     f"import socket\ntry:\n    socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)\n"
     f"    print('{SECRET}')\nexcept OSError:\n    print('no')", STDIO, 0.0),
    ("looks at the host through /proc/1/root",
     f"import os\nok = any(os.path.exists(f'/proc/{{p}}/root{REPO!s}')"
     f" for p in os.listdir('/proc')"
     f" if p.isdigit())\nprint('{SECRET}' if ok else 'no')", STDIO, 0.0),
    ("traces the harness",
     "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nwon = False\n"
     "for p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n"
     "        if libc.ptrace(16, int(p), 0, 0) == 0:\n            won = True\n"
     "        try:\n            open(f'/proc/{p}/mem', 'rb').close()\n            won = True\n"
     "        except OSError:\n            pass\n"
     f"def solve(x):\n    return {SECRET} if won else None", ASSERT, 0.0),
    ("reaches the network",
     f"import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
     f"    print('{SECRET}')\nexcept OSError:\n    print('no network')", STDIO, 0.0),
]


@pytest.fixture
def probe_config() -> RewardConfig:
    """No time limit a probe comes near: a timeout would score 0 for a reason of its own."""
    return RewardConfig(
        functions={"code": 1.0}, workers=2, timeout=BACKSTOP, request_timeout=BACKSTOP,
        code=CodeSandboxConfig(cpu_seconds=BACKSTOP, wall_seconds=BACKSTOP, memory_mb=256,
                               nproc=16, file_size_mb=1, max_output_bytes=64 * 1024))


async def _score_all(config, items):
    reward = CodeReward(config)
    await reward.start()
    try:
        return await asyncio.gather(*(reward.score(i) for i in items))
    finally:
        await reward.close()


async def test_probes_score_what_a_fair_grader_gives(probe_config):
    items = [ScoreItem(fn="code", response=program, truth=truth)
             for _, program, truth, _ in PROBES]
    scores = await _score_all(probe_config, items)
    wrong = [(name, s.reason) for (name, _, _, want), s in zip(PROBES, scores)
             if s.score != want]
    assert not wrong, wrong


async def test_no_host_unix_socket_is_reachable(probe_config):
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "host.sock")
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path)
            os.chmod(path, 0o777)
            server.listen(1)
            abstract = socket.socket(socket.AF_UNIX)
            abstract.bind(f"\0tandem-probe-{os.getpid()}")
            abstract.listen(1)
            program = (
                "import socket\nreached = []\n"
                f"for addr in ({path!r}, '\\0tandem-probe-{os.getpid()}'):\n"
                "    s = socket.socket(socket.AF_UNIX)\n    s.settimeout(1)\n"
                "    try:\n        s.connect(addr)\n        reached.append(addr)\n"
                "    except OSError:\n        pass\n"
                "print('reached' if reached else 'alone')")
            [got] = await _score_all(probe_config, [ScoreItem(
                fn="code", response=program, truth={"tests": [{"input": "", "output": "alone"}]})])
            abstract.close()
    assert got.score == 1.0, got.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="per-run uids and cgroups need root")
async def test_nothing_outlives_the_run(probe_config):
    """Files in /tmp, /var/tmp, /dev/shm and a System V shared memory segment are gone after
    the run, both for the host and for the next run."""
    tag = f"tandem-probe-{os.getpid()}"
    key = 0x7A110000 + (os.getpid() & 0xFFFF)  # this run's own System V key
    writer = (
        "import ctypes, os\n"
        f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n    open(d + '/{tag}', 'w').write('x')\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"shm = libc.shmget({key}, 4096, 0o1666)\n"  # IPC_CREAT | 0666
        "print('made' if shm >= 0 else 'no shm')")
    reader = (
        "import ctypes, os\n"
        f"left = [d for d in ('/tmp', '/var/tmp', '/dev/shm') if os.path.exists(d + '/{tag}')]\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"if libc.shmget({key}, 0, 0o666) >= 0:\n    left.append('shm')\n"
        "print(left)")
    config = probe_config.model_copy(update={"workers": 1})
    made, seen = await _score_all(config, [
        ScoreItem(fn="code", response=writer, truth={"tests": [{"input": "", "output": "made"}]}),
        ScoreItem(fn="code", response=reader, truth={"tests": [{"input": "", "output": "[]"}]})])
    assert made.score == 1.0, made.reason
    assert seen.score == 1.0, seen.reason
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(f"{folder}/{tag}")
    keys = [line.split()[0] for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert str(key) not in keys


@pytest.mark.skipif(os.geteuid() != 0, reason="the per-run memory limit is a cgroup (root)")
async def test_memory_is_limited_per_run_not_per_process(probe_config):
    """Six forked children of 150 MiB each stay under RLIMIT_AS (256 MiB) one by one; together
    they exceed the run's 256 MiB. Each child holds its block until the program ends (a pipe
    only the parent writes to), so without the run's limit all six are alive at the count."""
    program = (
        "import os, sys\nkids = []\nhold, release = os.pipe()\n"
        "for i in range(6):\n    r, w = os.pipe()\n    pid = os.fork()\n    if pid == 0:\n"
        "        os.close(release)\n"
        "        block = bytearray(150 << 20)\n        block[::4096] = b'x' * len(block[::4096])\n"
        "        os.write(w, b'1')\n        os.read(hold, 1)\n        os._exit(0)\n"
        "    kids.append(pid)\n    if os.read(r, 1) != b'1':\n        sys.exit(3)\n"
        "alive = sum(os.waitpid(p, os.WNOHANG)[0] == 0 for p in kids)\n"
        "print('held', alive * 150, 'MiB')")
    reward = CodeReward(probe_config)
    await reward.start()
    try:
        if reward.sandbox.cgroups is None:
            pytest.skip("no writable memory cgroup here (sandbox.memory_per_process)")
        got = await reward.score(ScoreItem(fn="code", response=program, truth={
            "tests": [{"input": "", "output": "held 900 MiB"}]}))
    finally:
        await reward.close()
    assert got.score == 0.0, got.reason
    # the kernel kills children as the run's budget runs out: never all six alive at once
    assert any(r in got.reason for r in ("memory", "exit code 3", "wrong_answer")), got.reason


async def test_per_test_limits_compose_with_the_evaluation_budget():
    """6 tests of 0.4 s each score 1.0 though together they take longer than reward.timeout;
    a test that ends by its limit (test 3 of 5 spins past its CPU seconds, which a loaded
    machine does not stretch as it does a wall clock that counts the sandbox's start) scores
    the documented 2/5."""
    config = RewardConfig(
        functions={"code": 1.0}, workers=1, timeout=1.5,
        code=CodeSandboxConfig(cpu_seconds=1, wall_seconds=BACKSTOP, memory_mb=256))
    slow = "import time\nn = int(input())\ntime.sleep(0.4)\nprint(n)"
    third_spins = "n = int(input())\nwhile n == 3:\n    pass\nprint(n)"
    tests = lambda n: {"tests": [{"input": f"{i}\n", "output": f"{i}\n"} for i in range(1, n + 1)]}
    async with LocalScorer(config=config) as scorer:
        slow_score, partial = await scorer.score([
            ScoreItem(fn="code", response=slow, truth=tests(6)),
            ScoreItem(fn="code", response=third_spins, truth=tests(5))])
    assert slow_score.score == 1.0, slow_score.reason
    assert partial.score == pytest.approx(0.4), partial.reason
    assert "test 3: cpu" in partial.reason


def test_a_missing_bwrap_is_a_clear_error(tmp_path):
    """Without bubblewrap on PATH the sandbox refuses to start and says what to install."""
    code = (
        "import asyncio\n"
        "from tandem.common.config.reward import CodeSandboxConfig\n"
        "from tandem.common.sandbox import Sandbox\n"
        "try:\n    asyncio.run(Sandbox(CodeSandboxConfig(), slots=1).start())\n"
        "except Exception as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=BACKSTOP, env={**os.environ, "PATH": str(tmp_path)})
    assert "bubblewrap" in done.stdout and "apt-get install bubblewrap" in done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="the per-run memory cgroup needs root")
async def test_cgroup_folders_of_a_dead_scorer_are_swept(probe_config):
    """A scorer killed with SIGKILL cannot remove its cgroup folders; the next sandbox does."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    first = CodeReward(probe_config)
    await first.start()
    try:
        if first.sandbox.cgroups is None:
            pytest.skip("no writable memory cgroup here")
        parent = next(iter(first.sandbox.cgroups.dirs.values())).parent
    finally:
        await first.close()
    stale = parent / f"tandem-sandbox-{dead.pid}-probe"
    (stale / "slot0").mkdir(parents=True)
    second = CodeReward(probe_config)
    await second.start()
    await second.close()
    assert not stale.exists()
