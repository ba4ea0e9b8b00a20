"""The time a `tandem up` invocation spends outside its run (issue 16 item 6), for two installs
side by side: typically the tree before a change and the tree after it.

    .venv/bin/python tools/bench_startup.py --tandem before=/old/.venv/bin/tandem \
        --tandem "exec=.venv/bin/tandem --set up.launch=exec" --tandem after=.venv/bin/tandem \
        [--preset fully_async] [--steps 10] [--rounds 2] [--out .bench/startup.json]

An install is a `tandem` executable, optionally followed by arguments for `tandem up` (the same
install with a switch). `--warm LABEL` runs that install's invocations through a warm process
(`tandem warm`, started by the tool from that install before the rounds, its own start-up
reported apart, stopped after): its runs are forks of that process, so their PSS is sampled
under it and their CPU seconds are its children's, plus the client's. Each round runs every install once, interleaved (the machine is shared
and noisy), on the same config: the quickstart task, one explorer, a tiny Qwen2 built locally,
`placement: auto`. From each summary it reads the run's wall-clock (the trace's), every
component's start-up seconds (process start to registered), the invocation end to end and the
time outside the run, and from the run's trace the seconds before its first span and after its
last (the start and the end apart); the shell's own time for the command is measured too. While a run goes
on, the PSS of each process of its tree is sampled (/proc/PID/smaps_rollup, every 0.2 s): the
table gives each component's peak, and the peak of the tree's sum. Before the rounds, each
install's interpreter imports what each component imports before it can register, alone and
under `-X importtime` (the seconds are its own sum of top-level imports). Prints tables,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

# What each component imports before it can register (its CLI imports them after parsing).
IMPORTS = {
    "master": ["tandem.master.service"],
    "buffer": ["tandem.buffer.service"],
    "reward": ["tandem.reward.service"],
    "trainer": ["tandem.trainer.trainer", "transformers.modeling_utils"],
    "explorer": ["tandem.explorer.service", "transformers.modeling_utils"],
}


def write_config(workdir: Path, model_dir: Path, *, preset: str, steps: int) -> Path:
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(0)
    config = {
        "name": f"startup-{preset}", "run_dir": str(workdir / "run"), "seed": 0,
        "model": {"path": str(model_dir)},
        "sync": {"preset": preset, "timeout": 120},
        "master": {"total_steps": steps, "taskset": {
            "path": str(write_jsonl(train[:256], workdir / "train.jsonl")), "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": 8, "repeat_times": 4,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 6}}],
        "trainer": {"groups_per_step": 8, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": 60.0},
        "logging": {"level": "warning"},
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def parse_summary(text: str) -> dict:
    """The summary rows `tandem up` prints at the end, as numbers."""
    rows = dict(re.findall(r"^\s*([a-z][a-z /-]+?): (.*)$", text, flags=re.MULTILINE))
    seconds = lambda s: float(s.split()[0])
    out = {"result": rows.get("result", "?")}
    for key in ("wall-clock", "end to end", "outside the run"):
        if key in rows:
            out[key.replace(" ", "_").replace("-", "_")] = seconds(rows[key])
    if "start-up seconds" in rows:
        out["startup"] = {name: float(value) for name, value in
                          re.findall(r"([\w-]+) ([\d.]+)", rows["start-up seconds"])}
    return out


def median(rows: list[dict], key: str, name: str | None = None) -> float:
    values = [r[key] if name is None else r[key].get(name) for r in rows]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def role(cmdline: list[str]) -> str | None:
    """The component a process of the run is, from its command line (None: not one)."""
    args = [a for a in cmdline if a]
    # a zygote forked by a warm run's `tandem up` keeps the warm process's command line
    if any(a.endswith(("tandem.master.zygote", "tandem.master.warm")) for a in args):
        return "zygote"
    script = next((Path(a).name for a in args if Path(a).name.startswith("tandem-")), None)
    if script is None:
        return None
    if script == "tandem-explorer" and "--name" in args:
        return args[args.index("--name") + 1]
    return script.removeprefix("tandem-")


def sample_pss(root: int, peaks: dict[str, float], total: list[float],
               warm: bool = False) -> None:
    """One sample of the tree under `root`: each component's PSS (MiB) into `peaks` (max), the
    tree's sum into total[0] (max). With `warm`, `root` is the warm process, which the tree
    includes (the memory it holds is the run's)."""
    try:
        top = psutil.Process(root)
        procs = [*([top] if warm else []), *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    now = 0.0
    for proc in procs:
        try:
            name = "warm" if proc.pid == root else role(proc.cmdline())
            pss = proc.memory_full_info().pss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        now += pss
        if name is not None:
            peaks[name] = max(peaks.get(name, 0.0), pss)
    total[0] = max(total[0], now)


def children_cpu(warm: psutil.Process | None) -> float:
    """CPU seconds of the processes the warm process waited for (its forks, and what each
    reaped in turn); 0 without one."""
    if warm is None:
        return 0.0
    times = warm.cpu_times()
    return times.children_user + times.children_system


def start_warm(tandem: str, socket: Path) -> tuple[subprocess.Popen, dict]:
    """`tandem warm` on `socket`, once it is ready (its ready line: seconds, pid)."""
    proc = subprocess.Popen([tandem, "warm", "--socket", str(socket)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    line = proc.stdout.readline()  # it answers once its imports are done, or exits
    if not line:
        raise SystemExit(f"{tandem} warm exited ({proc.wait(60)}) before it was ready")
    return proc, json.loads(line)


def run_once(tandem: list[str], config: Path, run_dir: Path,
             warm: tuple[subprocess.Popen, dict] | None = None) -> dict:
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server = psutil.Process(warm[0].pid) if warm else None
    warm_before = children_cpu(server)
    env = {**os.environ, "TANDEM_WARM": warm[1]["socket"]} if warm else None
    start = time.monotonic()
    began = time.time()
    proc = subprocess.Popen([tandem[0], "up", str(config), "--plain", *tandem[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    root = server.pid if server else proc.pid  # a warm run is the warm process's fork
    peaks: dict[str, float] = {}
    total = [0.0]
    sampling = True

    def sample() -> None:
        while sampling:
            sample_pss(root, peaks, total, warm=server is not None)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # the whole run, its components included
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {"result": "timed out after 300 s", "code": -1,
                "invocation": time.monotonic() - start}
    finally:
        sampling = False
        sampler.join(5)
    row = parse_summary(out)
    row["invocation"] = time.monotonic() - start
    row.update(around_the_run(run_dir, began, time.time()))
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of everything the invocation waited for: `tandem up`, and the components
    # it reaped (forked ones too: it is their subreaper). Load from others does not add to it.
    row["cpu"] = round(cpu.ru_utime + cpu.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
                       + children_cpu(server) - warm_before, 2)
    row["code"] = proc.returncode
    row["pss_mib"] = {k: round(v, 1) for k, v in sorted(peaks.items())}
    row["pss_tree_mib"] = round(total[0], 1)
    return row


def around_the_run(run_dir: Path, began: float, ended: float) -> dict:
    """The invocation's seconds before the run's first span (the start: imports, model loads,
    registration, the first barrier) and after its last one (the end: the last checkpoint's
    end to the invocation's exit), from the run's trace; `tandem up`'s own stop span is not
    the run's."""
    from tandem.common.trace import read_trace

    spans = [s for s in read_trace(run_dir) if s["component"] != "up"]
    if not spans:
        return {}
    return {"before_run": round(min(s["start"] for s in spans) - began, 2),
            "after_run": round(ended - max(s["end"] for s in spans), 2)}


def import_seconds(python: str, modules: list[str]) -> float:
    """Seconds `python -X importtime` reports for importing `modules` in a fresh interpreter:
    the sum of its top-level imports' cumulative times."""
    out = subprocess.run([python, "-X", "importtime", "-c", "import " + ", ".join(modules)],
                         capture_output=True, text=True, timeout=300, check=True).stderr
    total = 0
    for line in out.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and \
                not parts[2].startswith("  ") and parts[1].strip().isdigit():
            total += int(parts[1])
    return total / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tandem", action="append", required=True, metavar="LABEL=PATH",
                        help="an install's tandem executable, labelled, optionally followed "
                             "by arguments for tandem up (repeatable)")
    parser.add_argument("--preset", default="fully_async")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm", action="append", default=[], metavar="LABEL",
                        help="run this install's invocations through `tandem warm` (repeatable)")
    parser.add_argument("--out", default=".bench/startup.json")
    args = parser.parse_args()
    installs = {label: shlex.split(command) for label, command in
                (item.split("=", 1) for item in args.tandem)}

    from tandem.weights.tiny import build_tiny_model

    imports: dict[str, dict[str, float]] = {}
    for label, tandem in installs.items():
        python = str(Path(tandem[0]).parent / "python")
        imports[label] = {name: round(import_seconds(python, modules), 2)
                          for name, modules in IMPORTS.items()}
        print(f"imports {label}: {json.dumps(imports[label])}", file=sys.stderr, flush=True)

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        build_tiny_model(model_dir)
        config = write_config(workdir, model_dir, preset=args.preset, steps=args.steps)
        warm = {}
        try:
            for label in args.warm:
                warm[label] = start_warm(installs[label][0], workdir / f"{label}.sock")
                print(f"warm {label}: {json.dumps(warm[label][1])}", file=sys.stderr, flush=True)
            for rnd in range(args.rounds):
                for label, tandem in installs.items():
                    row = run_once(tandem, config, workdir / "run", warm.get(label))
                    row.update(label=label, round=rnd, load=os.getloadavg()[0])
                    rows.append(row)
                    print(f"round {rnd} {label}: {json.dumps(row)}", file=sys.stderr,
                          flush=True)
        finally:
            for proc, _ in warm.values():
                proc.terminate()
                proc.wait(300)

    print(f"\n{args.preset}, {args.steps} steps, {args.rounds} rounds interleaved (medians)\n")
    header = "| install | wall-clock | trainer start-up | explorer start-up | end to end | " \
             "outside the run | before the run | after the run | invocation | CPU seconds | load |"
    print(header)
    print("|---" * 11 + "|")
    summary = {}
    for label in installs:
        mine = [r for r in rows if r["label"] == label and r["code"] == 0]
        s = summary[label] = {
            "runs_ok": len(mine), "wall_clock": median(mine, "wall_clock"),
            "trainer_startup": median(mine, "startup", "trainer"),
            "explorer_startup": median(mine, "startup", "explorer-0"),
            "end_to_end": median(mine, "end_to_end"),
            "outside_the_run": median(mine, "outside_the_run"),
            "invocation": median(mine, "invocation"), "cpu": median(mine, "cpu"),
            "before_run": median(mine, "before_run"), "after_run": median(mine, "after_run"),
            "load": median(mine, "load"),
            "pss_mib": {name: median(mine, "pss_mib", name)
                        for name in sorted({n for r in mine for n in r["pss_mib"]})},
            "pss_tree_mib": median(mine, "pss_tree_mib")}
        print(f"| {label} | {s['wall_clock']:.1f} s | {s['trainer_startup']:.1f} s | "
              f"{s['explorer_startup']:.1f} s | {s['end_to_end']:.1f} s | "
              f"{s['outside_the_run']:.1f} s | {s['before_run']:.1f} s | {s['after_run']:.1f} s | "
              f"{s['invocation']:.1f} s | {s['cpu']:.1f} s | "
              f"{s['load']:.1f} |")
    names = ["master", "buffer", "reward", "trainer", "explorer-0", "zygote", "warm"]
    names = [n for n in names if any(n in summary[label]["pss_mib"] for label in installs)]
    print("\nPeak PSS per process, MiB (medians; the tree's peak is of the sum at one moment)\n")
    print("| install | " + " | ".join(names) + " | tree |")
    print("|---" * (len(names) + 2) + "|")
    for label in installs:
        pss = summary[label]["pss_mib"]
        print(f"| {label} | " + " | ".join(f"{pss[n]:.0f}" if n in pss else "-" for n in names)
              + f" | {summary[label]['pss_tree_mib']:.0f} |")
    print("\nImport seconds per component, fresh interpreter, -X importtime\n")
    print("| install | " + " | ".join(IMPORTS) + " |")
    print("|---" * (len(IMPORTS) + 1) + "|")
    for label in installs:
        print(f"| {label} | " + " | ".join(f"{imports[label][n]:.2f}" for n in IMPORTS) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    warm_ready = {label: ready for label, (_, ready) in warm.items()}
    for label, ready in warm_ready.items():
        print(f"\n{label}: `tandem warm` was ready after {ready['ready']:.1f} s of imports, "
              "once, before the rounds (not in the rows above)")
    out.write_text(json.dumps({"preset": args.preset, "steps": args.steps, "rows": rows,
                               "summary": summary, "imports": imports, "warm": warm_ready},
                              indent=2))
    print(f"\nwrote {out}")
    return 0 if all(r["code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
