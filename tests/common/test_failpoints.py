"""Failpoints stop a process at an exact place of its own work, once per arming, and only where
`TANDEM_FAILPOINTS` names a folder: what tools/chaos.py strikes at instead of racing a poll
loop (a strike that waited on wall-clock caps missed its moment under load)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from backstop import BACKSTOP
from tandem.common import failpoints

PASSES = """
from tandem.common import failpoints
print([failpoints.reached("trainer.leased") for _ in range(3)], flush=True)
"""


def _wait(predicate, what: str):
    deadline = time.monotonic() + BACKSTOP
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_armed_failpoint_stops_the_first_process_to_pass_it_once(tmp_path):
    folder = tmp_path / "failpoints"
    armed = failpoints.arm(folder, "trainer.leased")
    proc = subprocess.Popen([sys.executable, "-c", PASSES], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **{failpoints.ENV: str(folder)}))
    try:
        _wait(lambda: failpoints.stopped(proc.pid), "the process never stopped at the failpoint")
        assert not armed.exists()  # taken: a second process passing it would not stop
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=BACKSTOP)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert out.splitlines()[-1] == "[True, False, False]"  # once per arming
    assert not failpoints.disarm(folder, "trainer.leased")


def test_failpoints_are_inert_unless_the_environment_names_a_folder(tmp_path, monkeypatch):
    folder = tmp_path / "failpoints"
    failpoints.arm(folder, "explorer.put_acked")
    monkeypatch.delenv(failpoints.ENV, raising=False)
    assert failpoints.reached("explorer.put_acked") is False
    monkeypatch.setenv(failpoints.ENV, str(folder))
    assert failpoints.reached("trainer.leased") is False  # armed is another one
    assert failpoints.disarm(folder, "explorer.put_acked")  # still armed: nothing took it
    with pytest.raises(ValueError, match="unknown failpoint 'trainer.later'.*trainer.leased"):
        failpoints.arm(folder, "trainer.later")
