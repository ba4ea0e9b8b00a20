"""Three hosts that share nothing but TCP: Linux network namespaces made (and removed) here.

    ctrl       10.213.7.1   tandem-master, tandem-buffer
    trainer    10.213.7.2   tandem-trainer
    explorers  10.213.7.3   tandem-explorer explorer-0, explorer-1

Each namespace is joined to a bridge that lives in a fourth namespace, so neither the links nor
the private addresses exist outside the test's namespaces, and no namespace has a route to any
other address. The loopback device of each host carries only its own address: 127.0.0.1 and ::1
are removed, so a process that tried loopback would fail the run. Each host has its own folder
(run_dir, model copy, taskset): its processes run in a mount namespace where the other hosts'
folders are covered by empty tmpfs mounts, so one that tried to read or write another host's
files would not find them, and what it wrote there would be lost (the checks below would see it).

Two runs, each to its end: `fully_async` with `weights.transport: fetch` (no shared filesystem:
explorers download every version from the trainer) and `one_step_off_policy` (a gloo broadcast
from the trainer's namespace to the explorers' namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import pytest
import yaml

from processes import wait_for

from tandem.common.trace import read_trace
from tandem.master.quickstart import reversal_tasks, write_jsonl
from backstop import BACKSTOP

pytestmark = pytest.mark.slow

SUBNET = "10.213.7"  # private range; exists only inside the namespaces below
ADDRESS = {"ctrl": f"{SUBNET}.1", "trainer": f"{SUBNET}.2", "explorers": f"{SUBNET}.3"}
STEPS = 3
RUN_SECONDS = BACKSTOP
BIN = Path(sys.executable).parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=BACKSTOP,
                          check=check)


def _cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to create network namespaces"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"tdm{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """The namespaces, their links and addresses, and the processes started in them."""

    def __init__(self, root: Path, tag: str):
        self.root = root
        self.prefix = f"tdm{os.getpid() % 100000}{tag}"
        self.switch = f"{self.prefix}-sw"
        self.ns = {host: f"{self.prefix}-{host}" for host in ADDRESS}
        self.procs: list[tuple[str, str, subprocess.Popen, Path]] = []

    def folder(self, host: str) -> Path:
        return self.root / "hosts" / host

    def __enter__(self) -> Self:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (host, ns) in enumerate(self.ns.items()):
                _ip("netns", "add", ns)
                # both ends are created inside namespaces: nothing appears in the test's own
                _ip("link", "add", "eth0", "netns", ns, "type", "veth",
                    "peer", "name", f"port{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "del", "127.0.0.1/8", "dev", "lo")
                _ip("-n", ns, "addr", "del", "::1/128", "dev", "lo", check=False)
                _ip("-n", ns, "addr", "add", f"{ADDRESS[host]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self.folder(host).mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start(self, host: str, name: str, argv: list[str], model: Path) -> None:
        """Run `argv` in `host`'s namespace, the other hosts' folders hidden, `model` being
        this host's own copy."""
        hidden = [str(self.folder(h)) for h in ADDRESS if h != host]
        script = "set -e\n"
        script += f"mount --bind {self.folder(host) / 'model'} {model}\n"
        for folder in hidden:
            script += f"mount -t tmpfs -o size=1m tandem-hidden {folder}\n"
        script += 'exec "$@"\n'
        log = self.root / "logs" / f"{name}.out"
        log.parent.mkdir(exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], "sh", "-c", script, "sh", *argv],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((host, name, proc, log))

    def wait_all(self, seconds: float, serving: tuple[str, ...] = ()) -> dict[str, int]:
        """Exit codes once every process ended; `serving` ones (the buffer) serve until told
        to stop, as a supervisor would: they get SIGTERM once the others are done."""
        deadline = time.monotonic() + seconds
        codes = {}
        order = sorted(self.procs, key=lambda p: p[1] in serving)
        for _, name, proc, log in order:
            if name in serving and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                tails = "\n".join(f"--- {n}\n{_tail(lg)}" for _, n, _, lg in self.procs)
                pytest.fail(f"{name} did not finish within {seconds:g}s\n{tails}")
        return codes

    def stop(self) -> None:
        for _, _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, _, proc, _ in self.procs:
            try:
                proc.wait(timeout=BACKSTOP)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=BACKSTOP)

    def loopback_addresses(self, host: str) -> list[str]:
        shown = json.loads(_ip("-j", "-n", self.ns[host], "addr", "show", "dev", "lo").stdout)
        return [a["local"] for entry in shown for a in entry.get("addr_info", [])]

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for ns in [*self.ns.values(), self.switch]:
            # every process of ours in a namespace was started above and has ended; a
            # namespace that still holds one is reported rather than left behind
            left = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in left:
                os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _config(hosts: Hosts, host: str, preset: str, model: Path) -> Path:
    ctrl, trainer = ADDRESS["ctrl"], ADDRESS["trainer"]
    data = {
        "name": f"multihost-{preset}",
        "run_dir": str(hosts.folder(host) / "run"),
        "model": {"path": str(model)},
        # fully_async with a staleness bound of 1, so explorers must take new versions
        # (by fetch) within these few steps instead of finishing on the initial weights
        "sync": {"preset": preset, "timeout": BACKSTOP,
                 **({"max_staleness": 1} if preset == "fully_async" else {})},
        "master": {"address": f"tcp://{ctrl}:5550", "publish_address": f"tcp://{ctrl}:5551",
                   "total_steps": STEPS,
                   "taskset": {"path": str(hosts.folder("ctrl") / "train.jsonl"),
                               "epochs": 10}},
        "buffer": {"address": f"tcp://{ctrl}:5560"},
        "explorers": [{"name": f"explorer-{i}", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}} for i in range(2)],
        "trainer": {"groups_per_step": 4, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "weights": {"transport": "fetch", "fetch_address": f"tcp://{trainer}:5580",
                    "fetch_chunk_bytes": 2**16, "rendezvous_host": trainer,
                    "rendezvous_port": 5590},
        "transport": {"liveness": BACKSTOP},
        "logging": {"level": "info"},
    }
    path = hosts.folder(host) / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(tmp_path: Path, tiny_model_dir: Path, preset: str, tag: str):
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    model = tmp_path / "model"  # the same path on every host, each host's own copy under it
    model.mkdir()
    with Hosts(tmp_path, tag) as hosts:
        for host in ADDRESS:
            shutil.copytree(tiny_model_dir, hosts.folder(host) / "model")
        train, _ = reversal_tasks(0)
        write_jsonl(train[:64], hosts.folder("ctrl") / "train.jsonl")
        configs = {host: _config(hosts, host, preset, model) for host in ADDRESS}
        cfg = lambda host: ["--config", str(configs[host])]
        # servers bind every interface of their host, as `tandem deploy` renders them: the
        # address a client reaches them at is its own config's, never the bound wildcard
        bind = {"master": ["--set", "master.address=tcp://0.0.0.0:5550",
                           "--set", "master.publish_address=tcp://0.0.0.0:5551"],
                "buffer": ["--set", "buffer.address=tcp://0.0.0.0:5560"]}
        hosts.start("ctrl", "master", [str(BIN / "tandem-master"), *cfg("ctrl"),
                                       *bind["master"]], model)
        hosts.start("ctrl", "buffer", [str(BIN / "tandem-buffer"), *cfg("ctrl"),
                                       *bind["buffer"]], model)
        names = [f"explorer-{i}" for i in range(2)]
        for name in names:
            hosts.start("explorers", name, [str(BIN / "tandem-explorer"), *cfg("explorers"),
                                            "--name", name], model)
        # no barrier makes a fully_async run wait for every explorer: a short run could end on
        # explorer-0's groups before explorer-1 registers, which then finds no master. The
        # trainer, which drives the steps, starts once the master has registered both.
        master_log = next(log for _, name, _, log in hosts.procs if name == "master")
        wait_for(lambda: {e.get("name") for e in _log_events(master_log, "component.registered")}
                 >= set(names), RUN_SECONDS, "the master to register both explorers")
        hosts.start("trainer", "trainer", [str(BIN / "tandem-trainer"), *cfg("trainer")], model)
        codes = hosts.wait_all(RUN_SECONDS, serving=("buffer",))
        logs = {name: log for _, name, _, log in hosts.procs}
        assert codes == {name: 0 for name in codes}, "\n".join(
            f"--- {n} exited {c}\n{_tail(logs[n])}" for n, c in codes.items() if c)
        for host in ADDRESS:
            assert hosts.loopback_addresses(host) == [], host
        return hosts, logs


def _check_isolated_run(hosts: Hosts) -> dict[str, list[dict]]:
    """Each host's folder holds what its own components wrote, and only that."""
    ctrl, trainer, explorers = (hosts.folder(h) / "run" for h in ADDRESS)
    assert (ctrl / "buffer.sqlite").exists() and list((ctrl / "master").iterdir())
    assert not (ctrl / "weights").exists() and not (ctrl / "checkpoints").exists()
    assert list((trainer / "checkpoints").iterdir()), "the trainer wrote no checkpoint"
    for folder in (trainer, explorers):
        assert not (folder / "buffer.sqlite").exists() and not (folder / "master").exists()
    assert not (explorers / "checkpoints").exists()
    spans = {h: read_trace(hosts.folder(h) / "run") for h in ADDRESS}
    trains = [s for s in spans["trainer"] if s["kind"] == "train"]
    assert sorted(s["step"] for s in trains) == list(range(STEPS))
    rollouts = [s for s in spans["explorers"] if s["kind"] == "rollout"]
    # both registered before the first step (their exit codes say they ended with the run); in
    # fully_async either may have rolled out every group of so short a run
    assert rollouts and {s["component"] for s in rollouts} <= {"explorer-0", "explorer-1"}
    # no trace from another host's components landed in a host's folder
    assert {s["component"] for s in spans["trainer"]} <= {"trainer"}
    assert {s["component"] for s in spans["explorers"]} <= {"explorer-0", "explorer-1"}
    return spans


def _log_events(log: Path, event: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if event in line and line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def test_fully_async_with_fetched_weights_across_namespaces(tmp_path, tiny_model_dir):
    hosts, _logs = _run(tmp_path, tiny_model_dir, "fully_async", "a")
    spans = _check_isolated_run(hosts)
    explorers = hosts.folder("explorers") / "run"
    fetched = sorted(p.name for p in (explorers / "weights").iterdir())
    assert fetched and all(name.startswith("v") for name in fetched), fetched
    loads = [s for s in spans["explorers"] if s["kind"] == "sync"]
    assert loads, "no explorer loaded new weights"
    sent = _log_events(hosts.folder("trainer") / "run" / "logs" / "trainer.jsonl",
                       "weights.server_stopped")
    assert sent and sent[-1]["bytes_sent"] > 0


def test_one_step_off_policy_broadcast_across_namespaces(tmp_path, tiny_model_dir):
    hosts, _logs = _run(tmp_path, tiny_model_dir, "one_step_off_policy", "b")
    spans = _check_isolated_run(hosts)
    syncs = [s for s in spans["explorers"] if s["kind"] == "sync"]
    assert {(s.get("attrs") or {}).get("method") for s in syncs} == {"nccl"}
    assert not (hosts.folder("explorers") / "run" / "weights").exists()
