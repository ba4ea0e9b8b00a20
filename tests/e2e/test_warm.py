"""`tandem warm` (tandem.master.warm, issue 27 item 4): a warm process that imported torch,
transformers and `tandem up` once forks each `tandem up` run with TANDEM_WARM set.

One warm process serves every case of the first test, as a user's would: a run to its end,
printed and traced as the fork's; a SIGTERM to the client, relayed, stopping the run as it stops
a plain `tandem up`; a client SIGKILLed, whose run the warm process stops; a client whose
environment only an exec applies, refused and started cold; then the warm process's own
SIGTERM. Each moment mid-run is the run's own event (its first `train` span), never a delay.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import bench_stop
from chaos import children
from processes import wait_for
from tandem.common.trace import read_trace
from tandem.master.warm import changed_source, tandem_sources
from backstop import BACKSTOP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1560)]
TANDEM = str(Path(sys.executable).parent / "tandem")


def write_config(tmp_path: Path, model_dir: Path, name: str, steps: int) -> Path:
    workdir = tmp_path / name
    workdir.mkdir()
    path = bench_stop.write_config(workdir, model_dir, "fully_async", sync_timeout=BACKSTOP)
    config = yaml.safe_load(path.read_text())
    config["master"]["total_steps"] = steps
    # bounds that only catch a hang (tests/backstop.py): a loaded machine's slow stop or
    # silent component is not what these runs are about
    config["up"].update(run_timeout=BACKSTOP, stop_timeout=BACKSTOP / 3)
    config["transport"] = {"liveness": BACKSTOP}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_warm(socket: Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([TANDEM, "warm", "--socket", str(socket), "--idle", str(BACKSTOP)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], BACKSTOP)
    assert ready, "tandem warm said nothing"
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)


def until_training(client: subprocess.Popen, run_dir: Path) -> None:
    """Return once the run traced its first train step (the trace is the run's own clock)."""
    wait_for(lambda: client.poll() is not None or any(
        s["kind"] == "train" for s in read_trace(run_dir)), BACKSTOP, "a train span")
    assert client.poll() is None, client.communicate()


def test_runs_fork_from_the_warm_process_and_stop_as_plain_runs_do(tmp_path, tiny_model_dir):
    socket = tmp_path / "warm.sock"
    server, ready = start_warm(socket)
    env = {**os.environ, "TANDEM_WARM": str(socket)}
    try:
        assert ready["refused"] is None and ready["socket"] == str(socket)
        assert socket.stat().st_mode & 0o077 == 0  # only this user may connect

        # a run to its end: forked from the warm process, not started by the client
        config = write_config(tmp_path, tiny_model_dir, "end", steps=4)
        proc = subprocess.Popen([TANDEM, "up", str(config), "--plain"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=BACKSTOP)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        assert "result: finished" in out
        assert f"launch: forked from the warm process {ready['pid']} (tandem warm)" in out, out
        run_dir = config.parent / "run"
        spans = read_trace(run_dir)
        [stop] = [s for s in spans if s["component"] == "up"]
        assert stop["pid"] != proc.pid and stop["attrs"]["reason"] == "end of run"
        assert sorted(s["step"] for s in spans if s["kind"] == "train") == [0, 1, 2, 3]
        assert children(server.pid) == []  # the fork, its zygote and components all reaped

        # SIGTERM to the client reaches the run, which stops as a plain `tandem up` does
        config = write_config(tmp_path, tiny_model_dir, "sigterm", steps=100_000)
        client = subprocess.Popen([TANDEM, "up", str(config), "--plain"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        until_training(client, config.parent / "run")
        client.send_signal(signal.SIGTERM)
        out, err = client.communicate(timeout=BACKSTOP)
        assert client.returncode == 130, out[-3000:] + err[-3000:]
        assert "result: stopped by SIGTERM (130)" in out

        # a client that dies without a word: the warm process stops its run
        config = write_config(tmp_path, tiny_model_dir, "sigkill", steps=100_000)
        run_dir = config.parent / "run"
        client = subprocess.Popen([TANDEM, "up", str(config), "--plain"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        until_training(client, run_dir)
        [fork] = children(server.pid)
        client.kill()
        client.wait(BACKSTOP)
        wait_for(lambda: not children(server.pid), BACKSTOP, "the orphaned run to stop")
        [stop] = [s for s in read_trace(run_dir) if s["component"] == "up"]
        assert stop["pid"] == fork and stop["attrs"]["reason"] == "SIGTERM"
        assert stop["attrs"]["killed"] == []

        # an environment only an exec applies: refused, the client starts cold
        cold = subprocess.run([TANDEM, "up", "--help"], env={**env, "LD_BIND_NOW": "1"},
                              capture_output=True, text=True, timeout=BACKSTOP)
        assert cold.returncode == 0 and "Usage: tandem up" in cold.stdout
        assert "LD_BIND_NOW in the client's environment takes effect only at exec; starting " \
               "cold" in cold.stderr, cold.stderr
        # ... and one that sets what transformers read when the warm process imported it
        cold = subprocess.run([TANDEM, "up", "--help"], env={**env, "HF_HOME": str(tmp_path)},
                              capture_output=True, text=True, timeout=BACKSTOP)
        assert cold.returncode == 0 and "Usage: tandem up" in cold.stdout
        assert "refused: HF_HOME in the client's environment differs" in cold.stderr, cold.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(BACKSTOP)
    assert server.returncode == 0, server.stderr.read()
    assert not socket.exists()


def test_without_a_warm_process_tandem_up_starts_cold_and_says_so(tmp_path):
    socket = tmp_path / "none.sock"
    proc = subprocess.run([TANDEM, "up", "--help"], env={**os.environ, "TANDEM_WARM": str(socket)},
                          capture_output=True, text=True, timeout=BACKSTOP)
    assert proc.returncode == 0 and "Usage: tandem up" in proc.stdout
    assert f"tandem up: no warm process at {socket}" in proc.stderr
    assert proc.stderr.rstrip().endswith("starting cold")


def test_a_socket_in_a_folder_others_may_write_is_refused_before_any_import(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could replace the socket with their own
    proc = subprocess.run([TANDEM, "warm", "--socket", str(shared / "s.sock")],
                          capture_output=True, text=True, timeout=BACKSTOP)
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"tandem warm: {shared} is writable by others (mode 777); choose another --socket" \
        in proc.stderr, proc.stderr
    assert not (shared / "s.sock").exists()


def test_a_tandem_module_changed_on_disk_makes_the_warm_process_stale(tmp_path):
    sources = tandem_sources()
    assert any(path.endswith("tandem/master/warm.py") for path in sources)
    module = tmp_path / "module.py"
    module.write_text("x = 1\n")
    recorded = {module.__fspath__(): module.stat().st_mtime}
    assert changed_source(recorded) is None
    os.utime(module, (time.time(), module.stat().st_mtime + 1))
    assert changed_source(recorded) == str(module)
    module.unlink()
    assert changed_source(recorded) == str(module)
