"""Fuzz every server socket of a live run with hostile frames; report crashes and memory.

    .venv/bin/python tools/fuzz_wire.py [--frames 20000] [--steps 600] [--seed 0]
                                        [--out .bench/fuzz_wire.json]

Starts `tandem up` on a small fully_async run (tiny Qwen2, reward service on), waits for the
first trained step, then sends `--frames` hostile messages to each RPC server at once (master,
buffer, reward; the master's PUB socket only sends, so it has nothing to fuzz): random bytes,
truncated and bit-flipped valid messages, array/map/string headers that claim more than
follows, deep nesting, hundreds of frames, huge containers, and wrong envelopes (a reply sent
as a request, unknown types, bad versions, ids and bodies). Each socket is hit from several
client identities in turn. It counts the messages sent, the error replies by code, crashes
(a component that died or restarted, or an `internal` reply: a handler that failed), and reads
every component's RSS (`VmRSS` in /proc/PID/status) before and after, with the peak (`VmHWM`).
Then it lets the run finish (or, with `then="stop"` as the test uses, train a few more steps
and stop on SIGTERM) and checks its data: exit code 0, every step trained, the buffer database
passes SQLite's integrity check. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable

import msgpack
import yaml
import zmq

TARGETS = ("master", "buffer", "reward")
IDENTITY_EVERY = 250  # messages per client identity before the fuzzer reconnects as another


# -- hostile messages --------------------------------------------------------------------------


def _valid(target: str, rng: random.Random) -> list[bytes]:
    """A well-formed read-only request for `target` (mutated by the cases below)."""
    from tandem.common.codec import encode_request
    from tandem.common.messages import GetBufferStats, GetStatus, Heartbeat
    from tandem.common.messages.reward import GetRewardStats, ScoreBatch, ScoreItem

    if target == "reward":
        msg = rng.choice([GetRewardStats(), ScoreBatch(items=[
            ScoreItem(fn="k12", response=str(rng.randrange(100)), truth=str(rng.randrange(100)))
            for _ in range(rng.randrange(1, 4))])])
    elif target == "buffer":
        msg = GetBufferStats()
    else:
        msg = GetStatus()
    if rng.random() < 0.3:
        msg = Heartbeat(name=f"fuzz-{rng.randrange(1000)}")
    return [bytes(f) for f in encode_request(msg, f"v{rng.getrandbits(32):x}", ttl=5.0)]


def _envelope(type_: str, body, id_: str | None = None, **extra) -> bytes:
    return msgpack.packb({"v": 1, "type": type_, "id": id_ or f"f{random.getrandbits(40):x}",
                          "body": body, **extra})


def _raw_envelope(type_: str, body_raw: bytes) -> bytes:
    """Frame 0 whose body is the raw msgpack `body_raw` (which may lie about its sizes)."""
    head = msgpack.packb({"v": 1, "type": type_, "id": f"f{random.getrandbits(40):x}"})
    # turn the 3-entry fixmap into a 4-entry one and append "body": <raw>
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("body") + body_raw


def _type_of(target: str) -> str:
    return {"reward": "reward.score", "buffer": "buffer.put", "master": "master.register"}[target]


def _list_field(target: str) -> str:
    return {"reward": "items", "buffer": "experiences", "master": "meta"}[target]


def case_random(target: str, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 4))]


def case_truncated(target: str, rng: random.Random) -> list[bytes]:
    frames = _valid(target, rng)
    cut = rng.randrange(0, len(frames[0]))
    return [frames[0][:cut], *frames[1:]]


def case_bitflip(target: str, rng: random.Random) -> list[bytes]:
    frames = _valid(target, rng)
    head = bytearray(frames[0])
    for _ in range(rng.randrange(1, 6)):
        head[rng.randrange(len(head))] = rng.randrange(256)
    return [bytes(head), *frames[1:]]


def case_lying_header(target: str, rng: random.Random) -> list[bytes]:
    """Container or string headers that announce far more than the frame holds."""
    kind = rng.randrange(4)
    if kind == 0:  # array32 of 4 billion items, a few bytes long
        raw = b"\xdd" + struct.pack(">I", 2**32 - 1) + b"\xc0" * rng.randrange(0, 64)
    elif kind == 1:  # map32
        raw = b"\xdf" + struct.pack(">I", 2**32 - 1) + b"\xa1a\xc0" * rng.randrange(0, 16)
    elif kind == 2:  # str32 / bin32 of 2 GiB
        raw = rng.choice([b"\xdb", b"\xc6"]) + struct.pack(">I", 2**31) + b"x" * 16
    else:  # an array reference whose shape and bytes disagree
        return [_envelope(_type_of(target), {_list_field(target): [
            {"__nd__": ["float32", [2**40], 1]}]}), b"\0" * 8]
    if rng.random() < 0.5:
        return [raw]
    return [_raw_envelope(_type_of(target), b"\x81" + msgpack.packb(_list_field(target)) + raw)]


def case_deep_nesting(target: str, rng: random.Random) -> list[bytes]:
    depth = rng.choice([200, 1000, 5000, 100_000])
    nest = rng.choice([b"\x91", b"\x81\xa1k"]) * depth + b"\xc0"
    if rng.random() < 0.3:
        return [nest]
    body = b"\x81" + msgpack.packb(_list_field(target)) + b"\x91" + nest
    return [_raw_envelope(_type_of(target), body)]


def case_many_frames(target: str, rng: random.Random) -> list[bytes]:
    frames = _valid(target, rng)
    return [frames[0], *([b"x" * rng.randrange(0, 64)] * rng.choice([10, 500, 2000]))]


def case_huge_container(target: str, rng: random.Random) -> list[bytes]:
    """Up to a million real items: small maps, nils or strings, inside a valid envelope."""
    n = rng.choice([100_000, 1_000_000])
    kind = rng.randrange(3)
    if kind == 0:
        item = msgpack.packb({"fn": "k12", "response": "1", "truth": "1"})
    elif kind == 1:
        item = b"\xc0"
    else:
        item = msgpack.packb("y" * 8)
    raw = b"\xdd" + struct.pack(">I", n) + item * n
    return [_raw_envelope(_type_of(target), b"\x81" + msgpack.packb(_list_field(target)) + raw)]


def case_wrong_envelope(target: str, rng: random.Random) -> list[bytes]:
    id_ = f"w{rng.getrandbits(32):x}"
    choices = [
        msgpack.packb({"v": 1, "type": "reply", "id": id_, "ok": True, "result_type": "ok",
                       "result": {}}),
        msgpack.packb({"v": 1, "type": "reply", "id": id_, "ok": False,
                       "error": {"code": "x", "message": "y"}}),
        msgpack.packb({"v": 1, "type": "reply", "id": id_}),
        _envelope("no.such.type", {}, id_),
        _envelope("master.barrier", {"version": 1}, id_),
        _envelope(_type_of(target), [1, 2, 3], id_),
        _envelope(_type_of(target), {}, id_, ttl="soon"),
        msgpack.packb({"v": 2, "type": "heartbeat", "id": id_, "body": {"name": "x"}}),
        msgpack.packb({"v": 1, "type": "heartbeat", "id": 7, "body": {"name": "x"}}),
        msgpack.packb({"v": 1, "type": "heartbeat", "id": id_}),
        msgpack.packb([1, "heartbeat", id_]),
        msgpack.packb({"v": 1, "type": "heartbeat", "id": id_, "body": {"name": "x"},
                       "ttl": 1e308}),
    ]
    return [rng.choice(choices)]


CASES: dict[str, Callable[[str, random.Random], list[bytes]]] = {
    "random": case_random, "truncated": case_truncated, "bitflip": case_bitflip,
    "lying_header": case_lying_header, "deep_nesting": case_deep_nesting,
    "many_frames": case_many_frames, "huge_container": case_huge_container,
    "wrong_envelope": case_wrong_envelope,
}
WEIGHTS = {"random": 20, "truncated": 20, "bitflip": 30, "lying_header": 30, "deep_nesting": 30,
           "many_frames": 30, "huge_container": 1, "wrong_envelope": 39}  # of 200


def fuzz_socket(address: str, target: str, frames: int, seed: int,
                context: zmq.Context) -> dict:
    """Send `frames` hostile messages to the RPC server at `address`; count its replies."""
    rng = random.Random(seed)
    names, weights = zip(*WEIGHTS.items())
    sent: Counter = Counter()
    replies: Counter = Counter()
    sock = None

    def drain(wait_ms: int) -> None:
        while sock.poll(wait_ms, zmq.POLLIN):
            reply = sock.recv_multipart()
            try:
                head = msgpack.unpackb(reply[0])
                code = "ok" if head.get("ok") else head.get("error", {}).get("code", "?")
            except Exception:
                code = "undecodable"
            replies[code] += 1

    try:
        for i in range(frames):
            if i % IDENTITY_EVERY == 0:
                if sock is not None:
                    drain(200)
                    sock.close(linger=0)
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, 10_000)
                sock.setsockopt(zmq.IDENTITY, f"fuzz-{target}-{seed}-{i}".encode())
                sock.connect(address)
            case = rng.choices(names, weights)[0]
            sock.send_multipart(CASES[case](target, rng))
            sent[case] += 1
            drain(0)
            if i % 50 == 49:
                drain(20)  # pace: a fuzzer that only sends measures its own queue
        drain(1000)
    finally:
        if sock is not None:
            sock.close(linger=0)
    return {"sent": dict(sent), "replies": dict(replies)}


# -- the live run ------------------------------------------------------------------------------


SETTLE_TIMEOUT = 60.0  # a leak's bound: trimmed memory returns a second after the flood


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def component_pids(run_dir: Path) -> dict[str, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(cmd).decode(errors="replace")
        if str(run_dir) not in text:
            continue
        for name in TARGETS:
            if any(Path(p.decode(errors="replace")).name == f"tandem-{name}" for p in cmd[:2]):
                found[name] = int(entry.name)
    return found


def write_config(workdir: Path, model_dir: Path, steps: int) -> Path:
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(0)
    config = {
        "run_dir": str(workdir / "run"), "model": {"path": str(model_dir)},
        "sync": {"preset": "fully_async", "timeout": 60},
        "master": {"total_steps": steps, "taskset": {"path": str(
            write_jsonl(train[:64], workdir / "train.jsonl")), "epochs": 1000}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}, "service": True, "workers": 1},
        "logging": {"level": "warning", "metrics": {"port": 0}},  # runs may share this host
        "up": {"run_timeout": 1200, "timeline": False},
    }
    path = workdir / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def trained_steps(run_dir: Path) -> int:
    trace = run_dir / "trace" / "trainer.jsonl"
    return trace.read_text().count('"kind":"train"') if trace.exists() else 0


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"tandem up exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def fuzz_run(workdir: Path, model_dir: Path, *, frames: int, steps: int, seed: int = 0,
             settle: float = 2.0, run_timeout: float = 900.0, then: str = "finish",
             more_steps: int = 3, rss_growth_kib: int | None = None) -> dict:
    """Fuzz a live `tandem up` run in `workdir`; returns the report (see the module doc).

    After the fuzzing each component's heap is trimmed a second after its last refusal, in
    its own event loop: the report's "RSS after" is read `settle` seconds later, or, with
    `rss_growth_kib`, once every component's growth is back under it (at most SETTLE_TIMEOUT
    seconds, which only bounds a leak that never goes), so that a busy machine delaying the
    trim cannot turn a verdict.

    `then="finish"` lets the run train all `steps` afterwards; `then="stop"` waits for
    `more_steps` trained after the fuzzing and stops the run with SIGTERM, which must end it
    cleanly (exit 0): a run of many steps then always outlasts the fuzzing, however fast the
    machine trains."""
    config = write_config(workdir, model_dir, steps)
    run_dir = workdir / "run"
    tandem = str(Path(sys.executable).parent / "tandem")
    out_path = workdir / "up.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen([tandem, "up", str(config), "--plain"], stdout=out,
                                stderr=subprocess.STDOUT)
    context = zmq.Context()
    report: dict = {"frames_per_socket": frames, "steps": steps, "seed": seed, "targets": {}}
    try:
        _wait(lambda: trained_steps(run_dir) >= 1, 120, "the first trained step", proc)
        resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
        addresses = {"master": resolved["master"]["address"],
                     "buffer": resolved["buffer"]["address"],
                     "reward": resolved["reward"]["address"]}
        pids = _wait(lambda: (p := component_pids(run_dir)).keys() == set(TARGETS) and p,
                     10, "the master, buffer and reward processes", proc)
        for name, pid in pids.items():
            report["targets"][name] = {"pid": pid, "rss_before_kib": rss_kib(pid)[0]}
        started = time.monotonic()
        with ThreadPoolExecutor(len(TARGETS)) as pool:  # every socket at once
            results = list(pool.map(
                lambda k: fuzz_socket(addresses[TARGETS[k]], TARGETS[k], frames, seed * 1000 + k,
                                      context), range(len(TARGETS))))
        if rss_growth_kib is None:
            time.sleep(settle)  # refused messages' memory is trimmed a second after
        else:
            def trimmed(name: str) -> bool:
                try:
                    now = rss_kib(pids[name])[0]
                except OSError:
                    return True  # gone: a crash, counted below
                return now - report["targets"][name]["rss_before_kib"] < rss_growth_kib
            deadline = time.monotonic() + SETTLE_TIMEOUT
            while not all(map(trimmed, TARGETS)) and time.monotonic() < deadline:
                time.sleep(0.1)
        alive = component_pids(run_dir)
        if alive.keys() != set(TARGETS):
            # a component is gone: either the run finished meanwhile (its components exit on
            # their own and `tandem up` exits 0) or one crashed (then up fails the run)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        report["run_ended_before_fuzzing"] = proc.poll() == 0
        for name, result in zip(TARGETS, results):
            info = report["targets"][name]
            info.update(result)
            info["internal_replies"] = info["replies"].get("internal", 0)
            if report["run_ended_before_fuzzing"]:
                info["crashes"] = info["internal_replies"]
                continue
            info["same_process"] = alive.get(name) == info["pid"]
            if info["same_process"]:
                info["rss_after_kib"], info["rss_peak_kib"] = rss_kib(info["pid"])
            info["crashes"] = int(not info["same_process"]) + info["internal_replies"]
        report["fuzz_seconds"] = round(time.monotonic() - started, 1)
        report["steps_when_fuzz_ended"] = fuzz_end = trained_steps(run_dir)
        if then == "stop" and proc.poll() is None:
            try:
                _wait(lambda: trained_steps(run_dir) >= fuzz_end + more_steps, run_timeout,
                      f"{more_steps} steps trained after the fuzzing", proc)
            except RuntimeError as exc:
                report["stop_error"] = str(exc)
            proc.terminate()
        try:
            report["exit_code"] = proc.wait(timeout=run_timeout)
        except subprocess.TimeoutExpired:
            report["exit_code"] = None
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        context.term()
    report["steps_trained"] = trained_steps(run_dir)
    db = run_dir / "buffer.sqlite"
    if db.exists():
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            report["buffer_db"] = conn.execute("PRAGMA integrity_check").fetchone()[0]
    else:
        report["buffer_db"] = "missing"
    if then == "stop":  # trained on after the fuzzing and stopped cleanly when told to
        trained = report["steps_trained"] >= report.get("steps_when_fuzz_ended", 0) + more_steps
    else:
        trained = report["steps_trained"] == steps
    # `tandem up` stopped by SIGTERM exits 130 once every component stopped cleanly
    ended = report["exit_code"] == (130 if then == "stop" else 0)
    report["finished"] = ended and trained and report["buffer_db"] == "ok"
    report["crashes"] = sum(t.get("crashes", 1) for t in report["targets"].values())
    report["up_tail"] = out_path.read_text()[-2000:]
    return report


def print_table(report: dict) -> None:
    head = ("socket", "sent", "replies", "error replies", "internal", "crashed", "RSS before",
            "RSS after", "peak")
    rows = []
    for name, t in report["targets"].items():
        replies = t.get("replies", {})
        errors = sum(v for k, v in replies.items() if k != "ok")
        rows.append((name, sum(t.get("sent", {}).values()), sum(replies.values()), errors,
                     t.get("internal_replies", "-"),
                     {True: "no", False: "YES"}.get(t.get("same_process"), "run over"),
                     f"{t['rss_before_kib'] / 1024:.0f} MB",
                     f"{t['rss_after_kib'] / 1024:.0f} MB" if "rss_after_kib" in t else "-",
                     f"{t['rss_peak_kib'] / 1024:.0f} MB" if "rss_peak_kib" in t else "-"))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    print(f"\nfuzzing took {report.get('fuzz_seconds')} s; run: exit {report['exit_code']}, "
          f"{report['steps_trained']}/{report['steps']} steps trained "
          f"({report.get('steps_when_fuzz_ended')} when fuzzing ended), buffer db "
          f"{report['buffer_db']}; crashes {report['crashes']}; "
          f"{'finished' if report['finished'] else 'NOT FINISHED'}")
    if report.get("run_ended_before_fuzzing"):
        print("the run finished before fuzzing did: give it more --steps to measure every socket")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=20000, help="messages per socket")
    parser.add_argument("--steps", type=int, default=600, help="trainer steps of the run (it "
                        "must outlast the fuzzing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=".bench/fuzz_wire.json")
    args = parser.parse_args()
    from tandem.weights.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="tandem-fuzz-") as tmp:
        workdir = Path(tmp)
        build_tiny_model(workdir / "model")
        report = fuzz_run(workdir, workdir / "model", frames=args.frames, steps=args.steps,
                          seed=args.seed)
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    ok = report["crashes"] == 0 and report["finished"] and not report["run_ended_before_fuzzing"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
