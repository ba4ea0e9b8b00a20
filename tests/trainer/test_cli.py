"""`tandem-trainer` as a process: one-line errors with an exit code, a clean exit on SIGTERM."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from backstop import BACKSTOP
from tandem.common.sockets import free_port

EXE = str(Path(sys.executable).with_name("tandem-trainer"))


def unused_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def args(run_dir, model, *extra):
    return [EXE, "--set", f"run_dir={run_dir}", "--set", f"model.path={model}",
            "--set", f"master.address={unused_address()}", "--set", "logging.json_console=true",
            "--set", "transport.rpc_retries=0", *extra]


def test_help_and_bad_config_answer_without_a_traceback():
    """That neither imports torch is checked by tests/test_cli_edge.py, on the imports."""
    out = subprocess.run([EXE, "--help"], capture_output=True, text=True, timeout=BACKSTOP)
    assert out.returncode == 0 and "--resume" in out.stdout
    bad = subprocess.run([EXE, "--set", "trainer.clip_low=-1", "--set", "trainer.schedule=cosine"],
                         capture_output=True, text=True, timeout=BACKSTOP)
    assert bad.returncode == 2
    assert bad.stderr.startswith("tandem-trainer: invalid config")
    assert "trainer.clip_low" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_no_master_is_a_one_line_error_naming_the_key(tmp_path, tiny_model_path):
    cmd = args(tmp_path / "run", tiny_model_path, "--set", "transport.rpc_timeout=0.5")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=BACKSTOP)
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem-trainer: master at tcp://127.0.0.1:")
    assert "transport.rpc_timeout" in last and "Traceback" not in out.stderr


@pytest.mark.slow
def test_sigterm_while_waiting_exits_cleanly(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        args(run_dir, tiny_model_path, "--set", f"transport.rpc_timeout={BACKSTOP}"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = run_dir / "logs" / "trainer.jsonl"
        deadline = time.monotonic() + BACKSTOP
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and "trainer.connecting" in log.read_text():
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BACKSTOP) == 0
        assert "trainer.stopped" in log.read_text()
        assert not (run_dir / "checkpoints").exists()  # nothing trained, nothing to save
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
