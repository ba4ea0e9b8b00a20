"""A one-node Slurm cluster in a folder: munged, slurmctld and slurmd in the foreground, each with
its own pid and log file, on free ports, configured by a slurm.conf written here (no systemd, no
cgroup plugins: proctrack/linuxproc; task/affinity binds each step to the CPUs it was given, as
a production cluster's task/affinity or task/cgroup does). Clients find it through
`SLURM_CONF`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from backstop import BACKSTOP
from tandem.common.sockets import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")


def missing_tools() -> list[str]:
    """The Slurm and munge programs this machine lacks (`make slurm` installs them)."""
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    return [tool for tool in TOOLS if shutil.which(tool, path=path) is None]


def node_resources() -> tuple[int, int]:
    """This machine's CPUs and memory in MiB, as slurmd itself reads them (`slurmd -C`)."""
    text = subprocess.run([_tool("slurmd"), "-C"], capture_output=True, text=True, timeout=BACKSTOP,
                          check=True).stdout
    cpus = int(re.search(r"\bCPUs=(\d+)", text).group(1))
    memory = int(re.search(r"\bRealMemory=(\d+)", text).group(1))
    return cpus, memory


def _tool(name: str) -> str:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") or name


class SlurmCluster:
    """munged + slurmctld + slurmd for one node named after this host; `start()` returns once
    the node is idle, `stop()` ends every daemon (and what they started) and waits for it."""

    ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"})

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.daemons: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment a Slurm client (sbatch, scontrol) needs to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = BACKSTOP) -> None:
        for folder in ("munge", "state", "spool", "logs"):
            (self.root / folder).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True,
                       capture_output=True, timeout=BACKSTOP)
        key.chmod(0o400)
        # --force: munged refuses a socket folder below /tmp (world-writable) otherwise
        self._spawn("munged", [_tool("munged"), "--foreground", "--force",
                               f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                               f"--log-file={self.root / 'logs' / 'munged.log'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self._write_conf()
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_tool("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, f"node {self.node} to be idle")

    def _write_conf(self) -> None:
        cpus, memory = node_resources()
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=tandemtest",
            f"SlurmctldHost={self.node}",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'logs' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/affinity",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            # the job's steps get SIGTERM, then SIGKILL this many seconds later (scancel)
            "KillWait=30",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} "
            "State=UNKNOWN",
            "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            ""]))
        (r / "plugstack.conf").write_text("")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "logs" / f"{name}.out", "ab")
        try:
            self.daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  env=self.env, start_new_session=True)
        finally:
            log.close()

    def _node_idle(self) -> bool:
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
        state = self.scontrol("show", "node", self.node, check=False)
        return "State=IDLE" in state

    def scontrol(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([_tool("scontrol"), *args], capture_output=True, text=True,
                              env=self.env, timeout=BACKSTOP)
        if check and done.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, script: Path, cwd: Path, output: Path) -> int:
        """Submit `script` from `cwd`, its output to `output` (`%j`: the job id); the job id."""
        done = subprocess.run([_tool("sbatch"), "--parsable", f"--output={output}", str(script)],
                              capture_output=True, text=True, env=self.env, cwd=cwd, timeout=BACKSTOP)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def scancel(self, job: int, *options: str) -> None:
        subprocess.run([_tool("scancel"), *options, str(job)], check=True, capture_output=True,
                       env=self.env, timeout=BACKSTOP)

    def job(self, job: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, ...); {} once Slurm forgot it."""
        text = self.scontrol("show", "job", "--oneliner", str(job), check=False)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_job(self, job: int, timeout: float = BACKSTOP) -> dict[str, str]:
        """The job's record once it ended (its state is no longer PENDING, RUNNING, ...)."""
        record: dict[str, str] = {}

        def ended() -> bool:
            nonlocal record
            record = self.job(job)
            return record.get("JobState") not in self.ACTIVE

        try:
            self._wait(ended, timeout, f"job {job} to end")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} (it is {record.get('JobState')})") from None
        return record

    def log_tail(self, name: str, chars: int = 2000) -> str:
        text = ""
        for path in (self.root / "logs" / f"{name}.out", self.root / "logs" / f"{name}.log"):
            if path.exists():
                text += path.read_text(errors="replace")
        return text[-chars:]

    def stop(self) -> None:
        """Cancel every job, then SIGTERM each daemon (slurmd first), SIGKILL after 20 s."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            subprocess.run([_tool("scancel"), "--full", "--user=root"], capture_output=True,
                           env=self.env, timeout=BACKSTOP)
        for name in reversed(DAEMONS):
            proc = self.daemons.pop(name, None)
            if proc is None:
                continue
            for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue

    @staticmethod
    def _wait(predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.2)
