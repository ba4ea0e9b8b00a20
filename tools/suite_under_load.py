"""The whole suite, several times, with a second heavy load on the same cores (issue 31 item 2).

    .venv/bin/python tools/suite_under_load.py [--repo .] [--runs 5] [--load make-test]
        [--command "make test"] [--workdir /tmp/suite-under-load] [--out suite_under_load.json]
        [--pytest-args "-k codec"] [--load-pytest-args ...] [--run-timeout 3600]

It clones `--repo` (its committed HEAD) into a fresh directory, where `--command` runs each
time; `make test` there builds that clone's own venv on the first run, as a newcomer's would.
While each run goes, a second load keeps the cores busy from start to end:

- `make-test`: `make test` over and over in a second fresh clone (its own venv, built before
  the first run so that the build is not part of the load);
- `stress-ng`: `stress-ng --cpu <cores>` (Debian: `apt-get install stress-ng`);
- `none`: nothing (the quiet baseline).

`--pytest-args` reaches pytest through PYTEST_ADDOPTS (`-k codec` runs a tiny selection);
`--load-pytest-args` does the same for the load's `make test`; `--reuse-clones` keeps the
clones (and their venvs) of an earlier call, moved to the repo's HEAD. Prints one row per run
and writes them as JSON: run, load kind, result, pytest's passed/failed/error/skipped counts,
pytest's own seconds, the command's wall-clock seconds, the mean 1-minute load average, and
how many rounds of the load ran (and failed: a load failing at once is no heavy load).
The exit code is 0 only when every run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s",
                     re.MULTILINE)
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def clone(repo: Path, dest: Path, reuse: bool = False) -> None:
    """A fresh clone of `repo`'s HEAD at `dest`; with `reuse`, an earlier clone there is moved
    to that HEAD and cleaned instead, keeping its built .venv."""
    git = ["git", "-C", str(dest)]
    if reuse and (dest / ".git").exists():
        subprocess.run([*git, "fetch", "-q", str(repo), "HEAD"], check=True, timeout=600)
        subprocess.run([*git, "reset", "-q", "--hard", "FETCH_HEAD"], check=True, timeout=60)
        subprocess.run([*git, "clean", "-q", "-f", "-d", "-x", "-e", ".venv"], check=True,
                       timeout=60)
        return
    if dest.exists():
        shutil.rmtree(dest)
    subprocess.run(["git", "clone", "-q", str(repo), str(dest)], check=True, timeout=600)


def parse_pytest(output: str) -> dict:
    """pytest's closing line as numbers: {'passed': 898, ..., 'pytest_seconds': 540.1}."""
    found = list(SUMMARY.finditer(output))
    if not found:
        return {}
    last = found[-1]
    row: dict = {"pytest_seconds": float(last["seconds"])}
    for n, kind in COUNT.findall(last["counts"]):
        row["errors" if kind.startswith("error") else kind] = int(n)
    return row


def stop_group(proc: subprocess.Popen, what: str) -> None:
    """SIGINT the process group (pytest then tears its fixtures down, which stops the
    processes its test started), SIGTERM after 60 s, SIGKILL after 30 more; reaps the leader."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
    raise RuntimeError(f"{what} (pid {proc.pid}) survived SIGKILL for 30 s")


def sweep(clone_dir: Path) -> list[int]:
    """SIGKILL what is left of a stopped run: every process whose command line runs from
    `clone_dir` (its venv's python, its tandem executables). Returns their pids."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(clone_dir) in cmd:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                found.append(int(entry.name))
            except ProcessLookupError:
                pass
    return found


class Load:
    """A second heavy load that runs until stop(): `make test` in a loop, or stress-ng."""

    def __init__(self, kind: str, clone_dir: Path | None, env: dict, log: Path):
        self.kind, self.clone_dir, self.env, self.log = kind, clone_dir, env, log
        self.proc: subprocess.Popen | None = None
        self.rounds = 0
        self.failed_rounds = 0  # a load that fails at once (ruff, a collection error) is light
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.kind == "none":
            return
        if self.kind == "stress-ng":
            cores = str(os.cpu_count() or 2)
            self.proc = subprocess.Popen(["stress-ng", "--cpu", cores, "--quiet"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
            return
        self._thread = threading.Thread(target=self._loop, name="load", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with open(self.log, "ab") as out:
            while not self._stopping.is_set():
                self.proc = subprocess.Popen(["make", "test"], cwd=self.clone_dir, env=self.env,
                                             stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
                if self.proc.wait() != 0 and not self._stopping.is_set():
                    self.failed_rounds += 1
                self.rounds += 1

    def stop(self) -> None:
        self._stopping.set()
        if self.proc is not None:
            stop_group(self.proc, f"the {self.kind} load")
        if self.clone_dir is not None:
            sweep(self.clone_dir)
        if self._thread is not None:
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                raise RuntimeError("the make-test load loop did not end within 60 s")


def load_average_sampler(samples: list[float], done: threading.Event) -> threading.Thread:
    def sample() -> None:
        while not done.wait(5.0):
            samples.append(os.getloadavg()[0])
    thread = threading.Thread(target=sample, name="loadavg", daemon=True)
    thread.start()
    return thread


def run_once(i: int, args, suite: Path, env: dict, load: Load, logs: Path) -> dict:
    log = logs / f"run-{i}.log"
    samples: list[float] = []
    done = threading.Event()
    sampler = load_average_sampler(samples, done)
    load.start()
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(shlex.split(args.command), cwd=suite, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.run_timeout)
            result = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            stop_group(proc, args.command)
            sweep(suite)
            result = f"timed out after {args.run_timeout} s"
    wall = time.monotonic() - start
    load.stop()
    done.set()
    sampler.join(timeout=10)
    row = {"run": i, "load": args.load, "result": result, "wall_seconds": round(wall, 1),
           "load_avg": round(sum(samples) / len(samples), 2) if samples else None,
           "log": str(log)}
    row.update(parse_pytest(log.read_text(errors="replace")))
    if args.load == "make-test":
        row["load_rounds"], row["load_rounds_failed"] = load.rounds, load.failed_rounds
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", choices=["make-test", "stress-ng", "none"], default="make-test")
    parser.add_argument("--command", default="make test")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/suite-under-load"))
    parser.add_argument("--out", type=Path, default=Path("suite_under_load.json"))
    parser.add_argument("--pytest-args", default="", help="PYTEST_ADDOPTS of the measured runs")
    parser.add_argument("--load-pytest-args", default="", help="PYTEST_ADDOPTS of the load")
    parser.add_argument("--run-timeout", type=float, default=3600.0)
    parser.add_argument("--reuse-clones", action="store_true",
                        help="move clones left in --workdir to the repo's HEAD and keep their "
                             "venvs instead of cloning afresh")
    args = parser.parse_args()
    if args.load == "stress-ng" and shutil.which("stress-ng") is None:
        parser.error("--load stress-ng: stress-ng is not installed (apt-get install stress-ng)")

    args.workdir.mkdir(parents=True, exist_ok=True)
    logs = args.workdir / "logs"
    logs.mkdir(exist_ok=True)
    suite = args.workdir / "suite"
    clone(args.repo, suite, args.reuse_clones)
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTHONPATH")}
    env = dict(base_env, PYTEST_ADDOPTS=args.pytest_args)
    load_dir = None
    if args.load == "make-test":
        load_dir = args.workdir / "load"
        clone(args.repo, load_dir, args.reuse_clones)
        print(f"building the load clone's venv in {load_dir} ...", file=sys.stderr, flush=True)
        with open(logs / "load-install.log", "wb") as out:
            subprocess.run(["make", "install"], cwd=load_dir, env=base_env, check=True,
                           stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    load = Load(args.load, load_dir, dict(base_env, PYTEST_ADDOPTS=args.load_pytest_args),
                logs / "load.log")

    rows = []
    for i in range(args.runs):
        row = run_once(i, args, suite, env, load, logs)
        rows.append(row)
        print(f"run {i}: {json.dumps(row)}", file=sys.stderr, flush=True)
        args.out.write_text(json.dumps({"command": args.command, "repo": str(args.repo),
                                        "pytest_args": args.pytest_args, "runs": rows},
                                       indent=2))

    print(f"\n`{args.command}` in a fresh clone of {args.repo}, load: {args.load}\n")
    print("| run | load | result | passed | failed | errors | skipped | pytest s | wall s | "
          "load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['load']} | {r['result']} | {r.get('passed', 0)} | "
              f"{r.get('failed', 0)} | {r.get('errors', 0)} | {r.get('skipped', 0)} | "
              f"{r.get('pytest_seconds', '-')} | {r['wall_seconds']} | {r['load_avg']} |")
    print(f"\nwrote {args.out}")
    return 0 if all(r["result"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
