"""`tandem up`'s warm process (tandem.master.zygote, `up.launch: fork`): a component forked from
it is this process's child as one started by exec would be: its own session, its argv in
/proc, its log, SIGTERM's clean exit. A zygote that holds a thread refuses to fork. (Every e2e
test that runs `tandem up` runs its trainer and explorers forked.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from backstop import BACKSTOP
from tandem.master.zygote import Zygote, ZygoteRefused, needs_exec

BIN = Path(sys.executable).parent


def test_only_what_an_exec_would_apply_forces_an_exec():
    base = {"PATH": "/bin", "LD_PRELOAD": "", "PYTHONHASHSEED": "0"}
    same = dict(base, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
                MALLOC_MMAP_THRESHOLD_="65536", TANDEM_SECRET="x")
    assert needs_exec(same, base) is None
    assert needs_exec(dict(base, LD_PRELOAD="libx.so"), base) == "LD_PRELOAD"
    assert needs_exec(dict(base, MALLOC_ARENA_MAX="2"), base) == "MALLOC_ARENA_MAX"
    assert needs_exec({"PATH": "/bin", "LD_PRELOAD": ""}, base) == "PYTHONHASHSEED"


def master_config(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"{i}+1=", "answer": i + 1})
                             + "\n" for i in range(4)))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(tmp_path / "no-model")},
        "master": {"address": "tcp://127.0.0.1:0", "publish_address": "tcp://127.0.0.1:0",
                   "taskset": {"path": str(tasks), "id_field": "id"}, "total_steps": 4},
        "explorers": [{"name": "explorer-0"}], "logging": {"json_console": True}}))
    return path


def logged(log: Path, event: str, proc, timeout: float = BACKSTOP) -> dict:
    """The first line of `log` whose event is `event`, once the component wrote it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and json.loads(line).get("event") == event:
                return json.loads(line)
        time.sleep(0.1)
    raise AssertionError(f"no {event} in {log} (exit code {proc.poll()}):\n"
                         f"{log.read_text(errors='replace')[-2000:]}")


def test_a_forked_component_is_our_child_in_its_own_session_and_stops_on_sigterm(tmp_path):
    argv = [str(BIN / "tandem-master"), "--config", str(master_config(tmp_path))]
    zygote = Zygote(tmp_path / "zygote.out", BACKSTOP, [argv])
    log = tmp_path / "master.out"
    try:
        proc = zygote.fork(argv, dict(os.environ, OMP_NUM_THREADS="1"), log)
        try:
            logged(log, "master.started", proc)
            stat = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
            assert int(stat[1]) == os.getpid()  # re-parented to us, the subreaper
            assert os.getsid(proc.pid) == proc.pid
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            assert [a.decode() for a in cmdline] == [sys.executable, *argv]
            assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "tandem-master"
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(BACKSTOP) == 0, log.read_text()[-2000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(BACKSTOP)
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


def test_a_zygote_with_a_thread_refuses_to_fork(tmp_path, monkeypatch):
    # numpy's OpenBLAS starts its pool when it loads: the zygote then holds threads
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    argv = [str(BIN / "tandem-master"), "--help"]
    zygote = Zygote(tmp_path / "zygote.out", BACKSTOP, [argv])
    try:
        with pytest.raises(ZygoteRefused, match="threads"):
            zygote.fork(argv, dict(os.environ), tmp_path / "master.out")
    finally:
        zygote.close()
    assert not (tmp_path / "master.out").exists()


def test_closing_a_zygote_ends_it_whether_or_not_its_imports_are_done(tmp_path):
    # `tandem up` stopped while the zygote imports: it is terminated, not waited for (its
    # stdin is read only after the imports); once it answered, closing its stdin ends it
    argv = [str(BIN / "tandem-master"), "--help"]
    early = Zygote(tmp_path / "early.out", BACKSTOP, [argv])
    early.close()
    assert early.proc.returncode in (0, -signal.SIGTERM)
    ready = Zygote(tmp_path / "ready.out", BACKSTOP, [argv])
    ready.wait_ready()
    assert ready.refused is None and ready.ready_after is not None
    ready.close()
    assert ready.proc.returncode == 0


def test_a_forked_components_log_exists_when_fork_returns(tmp_path):
    """exec's path opens a component's log before the child runs; a forked component opens it
    itself, once it runs, which on a loaded machine came after the zygote's answer: a reader
    looking at once (this file's first test, under load) found no file. The interleaving made
    certain here: the zygote answers, and its component has not run (nor ever will)."""
    argv = [str(BIN / "tandem-master"), "--config", str(master_config(tmp_path))]
    zygote = Zygote(tmp_path / "zygote.out", BACKSTOP, [argv])
    sleeper = subprocess.Popen(["sleep", "600"])
    stdin = zygote.proc.stdin
    try:
        zygote.wait_ready()
        zygote.proc.stdin = open(os.devnull, "wb")  # the request reaches no zygote
        zygote._line = lambda: {"pid": sleeper.pid}  # whose answer names a process of ours
        log = tmp_path / "component.out"
        zygote.fork(argv, dict(os.environ), log)
        assert log.exists()
    finally:
        sleeper.kill()
        sleeper.wait(BACKSTOP)
        zygote.proc.stdin.close()
        zygote.proc.stdin = stdin
        zygote.close()


_SHARED_HEAP = """
import gc, os, sys, time
from tandem.master import zygote

heap = [[n] for n in range(1_000_000)]  # what the zygote imported, in small: 70 MiB
try:
    zygote.fork_component({"argv": ["component"]})
except zygote._Become:  # the component: a full collection, then its own copied pages
    gc.collect()
    with open("/proc/self/smaps_rollup") as f:
        dirty = next(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:"))
    with open(sys.argv[1] + ".tmp", "w") as out:
        out.write(str(dirty))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    os._exit(0)
# the zygote stays until the component has measured: once it is gone, the pages they shared
# are the component's alone and count as its private memory
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def test_a_full_collection_in_a_forked_component_leaves_the_zygotes_heap_shared(tmp_path):
    # the collector wrote to every object the zygote had imported when a component ran a full
    # collection, so each component copied the whole heap it had shared: the trainer's and the
    # explorer's private memory was 359 MiB where it is now 221 (tools/bench_peer.py), and
    # each full collection scanned every imported object (0.2 s a time)
    out = tmp_path / "dirty"
    subprocess.run([sys.executable, "-c", _SHARED_HEAP, str(out)], check=True,
                   timeout=BACKSTOP)
    deadline = time.monotonic() + BACKSTOP
    while not out.exists():
        assert time.monotonic() < deadline, "the forked component never reported"
        time.sleep(0.05)
    dirty_mib = int(out.read_text()) / 1024
    assert dirty_mib < 20, f"the component copied {dirty_mib:.0f} MiB of the zygote's heap"
