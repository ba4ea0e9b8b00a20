"""The suite's own process hygiene: pytest is the subreaper of everything the tests start, so
an orphan (a component whose `tandem up` was SIGKILLed, a sandboxed process whose namespace was
torn down) ends as pytest's zombie; `reap_orphans` waits for those after every test, and leaves
the children pytest started itself to their own waits."""

from __future__ import annotations

import subprocess
import sys
import time

from processes import reap_orphans, zombie_children

# forks a grandchild that outlives its parent, then exits once re-parented (to pytest)
ORPHANING = """
import os, time
parent = os.getpid()
if os.fork() == 0:
    while os.getppid() == parent:
        time.sleep(0.01)
    os._exit(0)
"""


def test_exited_orphans_are_reaped_and_our_own_children_keep_their_exit_codes():
    own = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING])
    assert parent.wait(30) == 0
    deadline = time.monotonic() + 30
    while len(zombie_children() - {parent.pid}) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the orphan and `own` both exited and wait for a parent's wait
    orphans = zombie_children() - {own.pid, parent.pid}
    assert len(orphans) == 1, orphans

    assert reap_orphans() == sorted(orphans)
    assert zombie_children() == {own.pid}
    assert own.wait(10) == 3  # still ours to wait for, with its own exit code
