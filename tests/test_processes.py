"""The no-leftover check sees what a test leaves anywhere below pytest, orphans included; the
exited orphans pytest (their subreaper) inherits are reaped, its own children left to their
waits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backstop import BACKSTOP
from processes import (descendants, kill_and_reap, reap_orphans, run_group, thread_states,
                       wait_for, zombie_children)

# A child that starts a grandchild and exits at once, printing the grandchild's pid: the shape of
# torchrun killed while its ranks run on.
ORPHANING = ("import subprocess, sys; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
             "print(p.pid)")


def ppid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and PR_SET_CHILD_SUBREAPER")
def test_an_orphaned_grandchild_is_re_parented_to_pytest_seen_and_reaped():
    out = subprocess.run([sys.executable, "-c", ORPHANING], capture_output=True, text=True,
                         timeout=BACKSTOP, check=True)
    orphan = int(out.stdout)
    try:
        assert ppid(orphan) == os.getpid()  # pytest is the subreaper, not init
        assert orphan in descendants()
    finally:
        kill_and_reap([orphan])
    assert not Path(f"/proc/{orphan}").exists()  # killed and reaped: not even a zombie
    assert orphan not in descendants()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_grandchildren_of_a_live_child_are_listed():
    child = subprocess.Popen([sys.executable, "-c",
                              ORPHANING + "; sys.stdout.flush(); p.wait()"],
                             stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        # exec closes Popen's error pipe (Popen returns, the child prints) before it has set
        # up the new program's arguments: /proc/PID/cmdline reads empty for that moment
        deadline = time.monotonic() + BACKSTOP
        while not (found := descendants()).get(grandchild) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert child.pid in found and grandchild in found
        assert "time.sleep(60)" in found[grandchild]
    finally:
        kill_and_reap([grandchild, child.pid])
        child.stdout.close()
    assert not {child.pid, grandchild} & set(descendants())


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_run_group_past_its_timeout_stops_the_grandchildren_too():
    # a child that waits on its own child: at the timeout both must be gone
    before = set(descendants())
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_group([sys.executable, "-c", ORPHANING + "; sys.stdout.flush(); p.wait()"],
                  timeout=2)
    assert timed_out.value.output.strip().isdigit()  # what it printed before the timeout
    assert set(descendants()) - before == set()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
@pytest.mark.timeout(300)
def test_run_group_with_stall_stops_a_group_that_only_waits_and_lets_one_that_computes_finish():
    # a group that waits (as a deadlocked run does) is hung after `stall`, long before its
    # `timeout` (the test's own 300 s would fail it first if `stall` did nothing)...
    before = set(descendants())
    with pytest.raises(subprocess.TimeoutExpired):
        run_group([sys.executable, "-c", ORPHANING + "; sys.stdout.flush(); p.wait()"],
                  timeout=3600, stall=3)
    assert set(descendants()) - before == set()
    # ... while one that computes goes on however long a loaded machine makes it take
    work = "import time\nend = time.process_time() + 2\nwhile time.process_time() < end: pass"
    assert run_group([sys.executable, "-c", work], timeout=3600, stall=30).returncode == 0
    # ... also when the computing happens in a session of its own, as `tandem up`'s components
    # do (counting the leader's group alone, a quickstart's GRPO phase looked hung at load 8)
    busy = "import time\nend = time.time() + 10\nwhile time.time() < end: pass"
    leader = (f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}], "
              "start_new_session=True, check=True)")
    assert run_group([sys.executable, "-c", leader], timeout=3600, stall=4).returncode == 0



@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
@pytest.mark.timeout(300)
def test_run_group_with_stall_is_not_fooled_by_another_process_exiting():
    # a process that is not the run's (what an earlier test left exiting, on CI) spent more CPU
    # than the run spends between two looks, and exits during the run: a sum over everything
    # below pytest dropped by its seconds and the run, computing a tenth of the time, looked hung
    spent = ("import sys, time\nend = time.process_time() + 1.5\n"
             "while time.process_time() < end: pass\nprint('spent', flush=True)\n"
             "sys.stdin.readline()")
    other = subprocess.Popen([sys.executable, "-c", spent], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "spent"
        # the run computes 10% of the time for 8 s (well over the 1% `stall` asks for); the
        # other process exits once the run is under way
        work = ("import time\nend = time.time() + 8\nwhile time.time() < end:\n"
                "    busy = time.time() + 0.05\n    while time.time() < busy: pass\n"
                "    time.sleep(0.45)\n")
        runner = threading.Thread(target=lambda: result.append(
            run_group([sys.executable, "-c", work], timeout=3600, stall=4)))
        result: list[subprocess.CompletedProcess] = []
        runner.start()
        wait_for(lambda: any("busy = time.time()" in command
                             for command in descendants().values()), BACKSTOP, "the run")
        other.stdin.write("\n")
        other.stdin.flush()
        other.wait(timeout=BACKSTOP)  # exited and reaped: out of /proc
        runner.join(timeout=BACKSTOP)
        assert result and result[0].returncode == 0, result
    finally:
        other.kill()
        other.wait(timeout=BACKSTOP)


# forks a grandchild that outlives its parent, then exits once re-parented (to pytest)
EXITING_ORPHAN = """
import os, time
parent = os.getpid()
if os.fork() == 0:
    while os.getppid() == parent:
        time.sleep(0.01)
    os._exit(0)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and PR_SET_CHILD_SUBREAPER")
def test_exited_orphans_are_reaped_and_our_own_children_keep_their_exit_codes():
    own = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    parent = subprocess.Popen([sys.executable, "-c", EXITING_ORPHAN])
    assert parent.wait(BACKSTOP) == 0
    deadline = time.monotonic() + BACKSTOP
    while len(zombie_children() - {parent.pid}) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the orphan and `own` both exited and wait for a parent's wait
    orphans = zombie_children() - {own.pid, parent.pid}
    assert len(orphans) == 1, orphans

    assert reap_orphans() == sorted(orphans)
    assert zombie_children() == {own.pid}
    assert own.wait(BACKSTOP) == 3  # still ours to wait for, with its own exit code


def test_thread_states_of_a_process_reaped_while_looked_at_is_empty(monkeypatch):
    """A process reaped between the look at its /proc folder and the listing of its threads
    (the interleaving `alive()` met in a loaded run: `Path.glob` saw /proc/PID/task, then its
    scandir raised FileNotFoundError) has no threads, it does not fail the test that asked."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=BACKSTOP)  # reaped: /proc/PID is gone
    monkeypatch.setattr(Path, "is_dir", lambda self: True)  # the folder was there when checked
    monkeypatch.setattr(Path, "exists", lambda self: True)
    assert thread_states(child.pid) == []
    assert thread_states(os.getpid()) != []  # a live process still has its threads
