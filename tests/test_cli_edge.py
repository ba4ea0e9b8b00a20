"""Every tandem CLI at its edge: a bad config, a peer or address it cannot reach, a run dir that
another process of the same component already holds.

The promise (docs/design.md §8, docs/deployment.md): exit code 2 for a bad config, 1 for a failure at run
time, and a domain error is one line `prog: message` on stderr, never a traceback. Each case runs
the real console script as a process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, UTC
from pathlib import Path

import pytest
import yaml
from backstop import BACKSTOP
from component_process import ComponentProcess
from processes import catches, freeze
from tandem.common.sockets import free_port

BIN = Path(sys.executable).parent
UNBINDABLE = "tcp://192.0.2.1:5550"  # TEST-NET-1: an address of no interface on this host


def unused_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def base(run_dir: Path, *extra: str) -> list[str]:
    """Overrides every CLI gets: its own run dir, loopback ports chosen by the OS, quiet logs."""
    return ["--set", f"run_dir={run_dir}", "--set", "logging.level=warning",
            "--set", "master.address=tcp://127.0.0.1:0",
            "--set", "master.publish_address=tcp://127.0.0.1:0",
            "--set", "buffer.address=tcp://127.0.0.1:0", "--set", "reward.address=tcp://127.0.0.1:0",
            "--set", "master.total_steps=1", *[x for kv in extra for x in ("--set", kv)]]


def argv(cli: str, run_dir: Path, model: Path, *extra: str) -> list[str]:
    """The command line of `cli` against `run_dir`, with `extra` as `--set` overrides."""
    if cli == "up":
        config = run_dir.parent / f"{run_dir.name}.yaml"
        config.write_text(yaml.safe_dump({"run_dir": str(run_dir), "model": {"path": str(model)}}))
        return [str(BIN / "tandem"), "up", str(config), "--plain", *base(run_dir, *extra)]
    argv = [str(BIN / f"tandem-{cli}"), *base(run_dir, f"model.path={model}", *extra)]
    return argv + (["--name", "explorer-0"] if cli == "explorer" else [])


PROG = {"up": "tandem up", "status": "tandem status", "timeline": "tandem timeline"}


def prog(cli: str) -> str:
    return PROG.get(cli, f"tandem-{cli}")


# Each verdict here is an exit code and a line, never a clock: the wall-clock bound only ends a
# process that hangs (tests/backstop.py). A component that exits on an unreachable master imports
# torch, loads its model and starts its reward workers first, 15 s of CPU that took 158 s of
# wall-clock beside three `make test` at once (load 13) and ran past the 120 s this bound once was.


def run(cmd: list[str], timeout: float = BACKSTOP,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


HEAVY = ("torch", "transformers", "vllm")


def heavy_imports_noted(folder: Path) -> dict[str, str]:
    """An environment in which importing torch, transformers or vllm writes
    `folder/imported-<name>` and fails: whatever the machine's speed, that file says whether a
    process got as far as a heavy import."""
    shadows = folder / "shadows"
    for name in HEAVY:
        (shadows / name).mkdir(parents=True, exist_ok=True)
        (shadows / name / "__init__.py").write_text(
            "from pathlib import Path\n"
            f"Path({str(folder / f'imported-{name}')!r}).write_text('')\n"
            f"raise ImportError('{name} is shadowed by this test')\n")
    return {**os.environ, "PYTHONPATH": str(shadows)}


def the_one_line(result: subprocess.CompletedProcess, cli: str) -> str:
    """The single `prog: ...` line (log lines may precede it), with no traceback anywhere."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "NameError" not in result.stderr
    mine = [line for line in result.stderr.splitlines() if line.startswith(f"{prog(cli)}: ")]
    assert len(mine) == 1, result.stderr[-3000:]
    assert result.stderr.rstrip().splitlines()[-1] == mine[0]
    return mine[0]


CLIS = ["master", "buffer", "reward", "explorer", "trainer", "up"]

BAD = {  # a value its section refuses, and the path the message must name
    "master": ("master.task_lease_seconds=-1", "master.task_lease_seconds"),
    "buffer": ("buffer.capacity=0", "buffer.capacity"),
    "reward": ("reward.workers=0", "reward.workers"),
    "explorer": ("explorers.0.batch_size=0", "explorers[0].batch_size"),
    "trainer": ("trainer.clip_low=-1", "trainer.clip_low"),
    "up": ("master.task_lease_seconds=-1", "master.task_lease_seconds"),
}


@pytest.mark.parametrize("cli", CLIS)
def test_a_bad_config_exits_2_with_one_line_naming_the_key(cli, tmp_path, tiny_model_dir):
    setting, key = BAD[cli]
    result = run(argv(cli, tmp_path / "run", tiny_model_dir, setting),
                 env=heavy_imports_noted(tmp_path))
    assert result.returncode == 2, result.stderr[-3000:]
    # nothing ran: the whole of stderr is the one line, and it came before any heavy import
    assert result.stderr.count("\n") == 1 and not result.stdout
    line = the_one_line(result, cli)
    assert line.startswith(f"{prog(cli)}: invalid config") and key in line
    assert not list(tmp_path.glob("imported-*"))


@pytest.mark.parametrize("module, command, args", [
    ("master", "master_main_command", []), ("buffer", "main", []), ("reward", "main", []),
    ("explorer", "main", []), ("trainer", "main", []), ("master", "tandem", ["up"]),
    ("master", "tandem", ["status"])])
def test_help_answers_without_importing_torch(module, command, args):
    out = run([sys.executable, "-c", (
        f"import sys\nfrom tandem.{module}.cli import {command} as main\n"
        f"try:\n    main({args + ['--help']})\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print(code, sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")])
    assert "--set" in out.stdout or "--master" in out.stdout, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout + out.stderr


@pytest.mark.parametrize("cli", ["master", "buffer", "reward"])
def test_an_address_it_cannot_bind_exits_1_with_one_line(cli, tmp_path, tiny_model_dir):
    key = {"master": "master.address", "buffer": "buffer.address", "reward": "reward.address"}
    result = run(argv(cli, tmp_path / "run", tiny_model_dir, f"{key[cli]}={UNBINDABLE}"))
    assert result.returncode == 1, result.stderr[-3000:]
    line = the_one_line(result, cli)
    assert f"cannot bind {UNBINDABLE}" in line


@pytest.mark.parametrize("cli", ["explorer", "trainer"])
def test_an_unreachable_master_exits_1_naming_the_peer_and_the_key(cli, tmp_path,
                                                                   tiny_model_dir):
    master = unused_address()
    result = run(argv(cli, tmp_path / "run", tiny_model_dir, f"master.address={master}",
                      "transport.rpc_timeout=0.5", "transport.rpc_retries=1"))
    assert result.returncode == 1, result.stderr[-3000:]
    line = the_one_line(result, cli)
    assert f"master at {master} did not answer master.register" in line
    # the wait it states is the one it made: two attempts of 0.5 s
    assert "within 1s (2 attempts of 0.5s)" in line and "raise transport.rpc_timeout" in line


def test_tandem_up_whose_master_cannot_start_exits_1_with_one_line(tmp_path, tiny_model_dir):
    result = run(argv("up", tmp_path / "run", tiny_model_dir, f"master.address={UNBINDABLE}"))
    assert result.returncode == 1, result.stderr[-3000:]
    line = the_one_line(result, "up")
    assert "master exited with code 1 while starting" in line
    assert f"tandem-master: cannot bind {UNBINDABLE}" in line and "logs/master.out" in line


def lock_holder(run_dir: Path, name: str, proc: subprocess.Popen | None = None,
                timeout: float = BACKSTOP) -> int:
    """The pid written into the run dir's lock for `name`, once a process holds it; fails at
    once if `proc`, which should take it, exits first. Every component takes its lock before
    it imports torch (tandem.common.cli.run_component); `timeout` only ends a start that hangs."""
    path = run_dir / "locks" / f"{name}.lock"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (text := path.read_text().strip()):
            return int(text)
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{name} exited {proc.returncode} before it took {path}")
        time.sleep(0.05)
    raise AssertionError(f"nobody took {path} within {timeout}s")


@pytest.mark.parametrize("cli", ["master", "buffer", "reward", "explorer", "trainer"])
def test_a_second_process_on_a_held_run_dir_exits_1_with_one_line(cli, tmp_path,
                                                                   tiny_model_dir):
    run_dir = tmp_path / "run"
    # the first one waits for a master nobody runs (explorer, trainer) or simply serves; its
    # register waits an hour, so it still holds the run dir, however slow the machine, when the
    # second one has been turned away
    waiting = ("transport.rpc_timeout=3600", f"master.address={unused_address()}")
    first = ComponentProcess(cli, argv(cli, run_dir, tiny_model_dir, *waiting))
    try:
        name = "explorer-0" if cli == "explorer" else cli
        holder = lock_holder(run_dir, name, first.proc)
        assert holder == first.proc.pid
        # the lock comes before any heavy import: the second one learns who holds the run
        # dir without loading torch or transformers (the trainer used to import torch first)
        notes = tmp_path / "second"
        result = run(argv(cli, run_dir, tiny_model_dir, *waiting),
                     env=heavy_imports_noted(notes))
        assert result.returncode == 1, result.stderr[-3000:]
        line = the_one_line(result, cli)
        assert f"run dir {run_dir} is in use: another {name} (pid {holder})" in line
        assert not list(notes.glob("imported-*")), list(notes.glob("imported-*"))
        assert first.proc.poll() is None  # the first one is untouched
    finally:
        first.stop()


def test_a_second_tandem_up_on_a_held_run_dir_exits_1_with_one_line(tmp_path, tiny_model_dir):
    from tandem.common.runlock import RunDirLock

    run_dir = tmp_path / "run"
    # held here rather than by a first `tandem up`, which would start a whole run's processes;
    # the lock is the same record lock a running supervisor holds
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom tandem.common.runlock import RunDirLock\n"
        f"RunDirLock({str(run_dir)!r}, 'up').acquire()\nprint('held', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run(argv("up", run_dir, tiny_model_dir))
        assert result.returncode == 1, result.stderr[-3000:]
        line = the_one_line(result, "up")
        assert f"another up (pid {holder.pid})" in line
        assert not (run_dir / "logs" / "master.out").exists()  # nothing was started
    finally:
        holder.stdin.close()
        holder.wait(BACKSTOP)
    with RunDirLock(run_dir, "up"):  # released when its holder exited
        pass


def test_tandem_status_without_a_master_is_one_line_in_the_same_form():
    master = unused_address()
    result = run([str(BIN / "tandem"), "status", "--master", master, "--timeout", "0.2"])
    assert result.returncode == 1 and not result.stdout
    line = the_one_line(result, "status")
    assert line.startswith(f"tandem status: master at {master} did not answer master.status")



def test_a_tandem_subcommand_failure_is_one_line_named_after_it(tmp_path):
    # `tandem timeline` on a run dir with no trace: click's "Error: ..." reads as every CLI does
    result = run([str(BIN / "tandem"), "timeline", str(tmp_path)])
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    line = the_one_line(result, "timeline")
    assert line == f"tandem timeline: {tmp_path}: the trace has no rollout, train or sync spans"


def test_tandem_up_whose_master_refuses_the_config_exits_2(tmp_path, tiny_model_dir):
    # valid to the config models, refused by the master: a run with no length
    cmd = argv("up", tmp_path / "run", tiny_model_dir)
    at = cmd.index("master.total_steps=1")
    result = run(cmd[:at - 1] + cmd[at + 1:])
    assert result.returncode == 2, result.stderr[-3000:]
    line = the_one_line(result, "up")
    assert "master exited with code 2 while starting" in line and "master.total_steps" in line


@pytest.mark.parametrize("cli", ["explorer", "trainer"])
def test_sigterm_while_waiting_for_an_absent_master_exits_0_at_once(cli, tmp_path,
                                                                    tiny_model_dir):
    run_dir = tmp_path / "run"
    # the registration waits an hour for the absent master unless SIGTERM ends it; the same
    # start shows the CLI applying its placement itself: torch, once loaded, runs the
    # configured thread count (three, which no default gives on this machine)
    share = "placement.explorers.threads=3" if cli == "explorer" else "placement.trainer.threads=3"
    waiting = ComponentProcess(cli, argv(cli, run_dir, tiny_model_dir,
                                         "transport.rpc_timeout=3600",
                                         f"master.address={unused_address()}", share,
                                         "logging.json_console=true", "logging.level=info"))
    try:
        waiting.wait_for(f"{cli}.connecting")
        applied = [e for e in waiting.events if e.get("event") == "placement.applied"]
        assert applied and applied[0]["threads"] == 3, applied
        torch_threads = [e["torch_threads"] for e in waiting.events
                         if e.get("event") == "placement.torch"]
        assert torch_threads == [3], torch_threads
        time.sleep(0.5)  # most likely in the middle of the wait; just before it stops it too
        # exit code 0 long before the hour is up: the signal ended the wait
        assert waiting.stop() == 0
        assert not any("Traceback" in line for line in waiting.raw)
    finally:
        waiting.stop()


def test_sigterm_while_the_trainer_loads_its_model_is_a_clean_stop(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    loading = ComponentProcess("trainer", argv("trainer", run_dir, tiny_model_dir,
                                               f"master.address={unused_address()}",
                                               "logging.json_console=true", "logging.level=info"))
    try:
        lock_holder(run_dir, "trainer")
        # The moment: its SIGTERM handler is in place, which the CLI installs right before
        # building the trainer (transformers, the model: seconds). Frozen there, it has not
        # built anything yet, and the signal is waiting for it when it goes on.
        pid = loading.proc.pid
        deadline = time.monotonic() + BACKSTOP
        while not catches(pid, signal.SIGTERM):
            assert time.monotonic() < deadline and loading.proc.poll() is None, \
                "the trainer never installed its SIGTERM handler"
            time.sleep(0.002)
        freeze(pid)
        sent = datetime.now(UTC)
        loading.proc.send_signal(signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)
        assert loading.proc.wait(BACKSTOP) == 0  # not killed by the signal: built, then stopped
        loading.wait_for("trainer.stopped")
        [connecting] = [e for e in loading.events if e["event"] == "trainer.connecting"]
        assert datetime.fromisoformat(connecting["timestamp"]) > sent  # it was still building
    finally:
        loading.stop()


async def test_a_stop_requested_before_serve_makes_every_service_return(tmp_path, tiny_model_dir,
                                                                       zmq_sockets_closed):
    """`request_stop()` holds whenever it comes: a signal may arrive before serve() ran."""
    from tandem.buffer import Buffer
    from tandem.common.config import load_config
    from tandem.explorer import Explorer
    from tandem.master.service import Master
    from tandem.reward import RewardService
    from tandem.trainer import Trainer

    config = load_config(None, base(tmp_path / "run", f"model.path={tiny_model_dir}")[1::2])
    for component in (Master(config), Buffer(config), RewardService(config),
                      Explorer(config, "explorer-0"), Trainer(config)):
        component.request_stop()
        try:
            await asyncio.wait_for(component.serve(), BACKSTOP)
            if isinstance(component, RewardService):
                # stopped before it began: no worker process was started
                assert component.scorer._pool is None, component.scorer._pool
        finally:
            await component.close()
