"""The control plane installs and runs without torch (issue 13, docs/design.md §1).

A fresh venv (no system site-packages) gets only tandem-common, tandem-master and tandem-buffer
from their folders; torch is then not importable there, and from that venv `tandem plan` draws
a plan, a `tandem-master` and a `tandem-buffer` come up on loopback, answer (`tandem status`, a
buffer stats request) and leave with exit code 0 on SIGTERM. Installing takes about 25-40 s on
two cores (pip's cache, one build backend for the three wheels), hence `slow`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from component_process import ComponentProcess
from tandem.common.messages import GetBufferStats
from tandem.common.rpc import RpcClient
from backstop import BACKSTOP

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONTROL_PLANE = ["common", "master", "buffer"]


def pip(venv: Path, *args: str) -> None:
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                          "install", "-q", "--no-compile", *args],
                         capture_output=True, text=True, timeout=BACKSTOP,
                         env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert run.returncode == 0, f"pip install {' '.join(args)} failed:\n{run.stderr[-3000:]}"


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv holding the control plane and its dependencies, nothing else of tandem."""
    path = tmp_path_factory.mktemp("control-plane") / "venv"
    # no pip of its own: ensurepip alone took 5-20 s
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=BACKSTOP)
    # One build backend in the venv instead of an isolated build env per package.
    pip(path, "hatchling")
    pip(path, "--no-build-isolation", *(str(ROOT / "packages" / p) for p in CONTROL_PLANE))
    return path


def run_in(venv: Path, *argv: str, timeout: float = BACKSTOP) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True,
                          text=True, timeout=timeout)


def test_the_venv_has_the_control_plane_and_no_torch(venv):
    for module in ("torch", "transformers", "safetensors", "tandem.weights", "tandem.explorer",
                   "tandem.trainer"):
        probe = run_in(venv, "python", "-c", f"import {module}")
        assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr, module
    probe = run_in(venv, "python", "-c", "import tandem.common, tandem.master, tandem.buffer")
    assert probe.returncode == 0, probe.stderr


def test_tandem_plan_runs_without_torch(venv):
    plan = run_in(venv, "tandem", "plan", "--preset", "fully_async", "--steps", "4", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)


def write_config(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"{i}+1=", "answer": i + 1})
                             + "\n" for i in range(8)))
    config = {
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "no-model-needed")},
        "sync": {"preset": "fully_async", "timeout": BACKSTOP},
        "master": {"address": "tcp://127.0.0.1:0", "publish_address": "tcp://127.0.0.1:0",
                   "taskset": {"path": str(tasks), "id_field": "id"}, "total_steps": 4},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2}],
        "logging": {"json_console": True},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_master_and_buffer_serve_without_torch_and_stop_on_sigterm(venv, tmp_path):
    config = write_config(tmp_path)
    bin_dir = venv / "bin"
    master = ComponentProcess("tandem-master", [str(bin_dir / "tandem-master"),
                                                "--config", str(config)])
    buffer = ComponentProcess("tandem-buffer", [str(bin_dir / "tandem-buffer"), "--config",
                                                str(config), "--address", "tcp://127.0.0.1:0"])
    try:
        address = master.wait_for("master.started")["address"]
        buffer_address = buffer.wait_for("buffer.listening")["address"]
        status = run_in(venv, "tandem", "status", "--master", address, "--json", timeout=BACKSTOP)
        assert status.returncode == 0, status.stderr
        assert "run_id" in json.loads(status.stdout)
        client = RpcClient(buffer_address, peer="buffer", name="test")
        try:
            stats = await client.call(GetBufferStats(), timeout=BACKSTOP, retries=0)
        finally:
            await client.close()
        assert stats.groups_ready == 0 and stats.bytes == 0
        for process in (buffer, master):
            process.proc.send_signal(signal.SIGTERM)
            assert process.proc.wait(BACKSTOP) == 0, f"{process.name}: {''.join(process.raw[-10:])}"
    finally:
        buffer.stop()
        master.stop()
