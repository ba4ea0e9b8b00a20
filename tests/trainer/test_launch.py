"""`tandem-torchrun` (tandem.trainer.launch): a SIGTERM stop of the trainer's ranks is exit 0
without a traceback; torchrun itself answers it with exit 1 and the re-raised signal, which a
supervisor reads as a crash. A rank that fails is still a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from backstop import BACKSTOP

BIN = Path(sys.executable).parent

RANK = f"""
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a rank leaves cleanly on the stop
Path(sys.argv[1], os.environ["RANK"]).write_text("ready")
if sys.argv[2] == "fail":
    sys.exit(3)
time.sleep({BACKSTOP})
"""


def launch(tmp_path: Path, launcher: str, mode: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    ready = tmp_path / "ready"
    ready.mkdir(exist_ok=True)
    return subprocess.Popen(
        [str(BIN / launcher), "--standalone", "--nproc-per-node=2", str(script), str(ready),
         mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def both_ranks_ready(tmp_path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + BACKSTOP
    while len(list((tmp_path / "ready").iterdir())) < 2:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)


@pytest.mark.parametrize("launcher", ["tandem-torchrun", "torchrun"])
def test_a_sigterm_stop_of_the_ranks_is_exit_0_without_a_traceback(tmp_path, launcher):
    proc = launch(tmp_path, launcher, "wait")
    try:
        both_ranks_ready(tmp_path, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=BACKSTOP)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(BACKSTOP)
    if launcher == "torchrun":  # what the launcher is for: torchrun calls this stop a crash
        assert proc.returncode == 1 and "SignalException" in out, out
        return
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "SIGTERM passed to the trainer's ranks" in out, out


def test_a_failing_rank_is_still_a_failure(tmp_path):
    proc = launch(tmp_path, "tandem-torchrun", "fail")
    out, _ = proc.communicate(timeout=BACKSTOP)
    assert proc.returncode != 0, out
