"""Weight sync: checkpoint publish+load and bucketed broadcast, each next to its raw ceiling.

Synthetic tensors with the shapes of Qwen2.5-0.5B (scaled in layers and vocabulary to
`--params`), in bf16. Measured in the same run, `--repeat` times each, interleaved:

- memcpy: one clone of every tensor (the cost of touching the bytes once);
- raw safetensors: `save_file` then reading every tensor back into a preallocated copy
  (what `load_weights` does), with and without fsync of the file;
- checkpoint: `WeightPublisher.publish` (shards, fsync, checksums, manifest, atomic rename)
  then `WeightSubscriber.load` (checksum check, mmap) into the same preallocated copy;
- flat broadcast: one `torch.distributed` gloo broadcast of a single flat tensor of the same
  size to a second process, until that process has confirmed it through the store;
- tandem broadcast: `WeightBroadcaster.broadcast` to a `WeightReceiver` in the second process
  (metadata, per-dtype buckets of `--bucket-mib`, confirmation);
- shared memory (`weights.transport: shared_memory`): `SharedMemoryPublisher.publish` (one copy
  into a /dev/shm segment), then the load in a second process, an explorer that maps the
  segment and copies every tensor into its preallocated model, timed there; next to it a copy
  of every tensor into a preallocated destination in this process (the same bytes, the same
  one copy, no mapping).

    python tools/bench_weights.py                       # 50M params (100 MB), about a minute
    python tools/bench_weights.py --params 500000000    # 0.5B params (1 GB)
    python tools/bench_weights.py --device cuda         # NCCL, where there is a GPU
    python tools/bench_weights.py --transport fetch     # weights.transport: fetch (below)

`--transport fetch` measures the time to bring one published version to 1, 2 and 4 explorers
(separate processes, each a `WeightFetcher` writing its own folder) from a `WeightServer` in a
process of its own, next to a single-stream raw file copy of the same shards (+ fsync).

With `--device cuda` the two processes use cuda:0 and cuda:1 (or both cuda:0 when only one
GPU exists, which NCCL may refuse; the run then reports CUDA-to-CUDA copies instead and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN05 = dict(vocab=151936, hidden=896, layers=24, intermediate=4864, kv=128)
QWEN05_PARAMS = 494_032_768


def shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-0.5B tensor shapes, layers and vocabulary scaled so the total is near `params`."""
    scale = params / QWEN05_PARAMS
    h, f, kv = QWEN05["hidden"], QWEN05["intermediate"], QWEN05["kv"]
    vocab = max(1024, round(QWEN05["vocab"] * scale))
    layers = max(1, round(QWEN05["layers"] * scale))
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    return out


def make_tensors(params: int, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    return [(name, torch.randn(shape, generator=g).to(torch.bfloat16).to(device))
            for name, shape in shapes(params)]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------- receiver process


def receiver_main(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from tandem.weights import WeightReceiver

    device = args.receiver_device
    raw = dist.TCPStore("127.0.0.1", args.flat_port, None, False,
                        datetime.timedelta(seconds=120), wait_for_workers=False)
    flat_pg = build_flat_group(raw, 1, device)
    total = int(raw.get("numel"))
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    receiver = WeightReceiver(json.loads(args.rendezvous), "bench/w0", device=device,
                              timeout=120.0, reuse_buffers=True)
    receiver.join()
    for i in range(args.repeat + 1):  # round 0 is the sender's untimed warm-up
        for _ in receiver.receive(i):
            pass
        flat_broadcast(flat_pg, flat)
        raw.set(f"got/{i}", b"1")
    receiver.close()


def build_flat_group(store, rank: int, device: str):
    """The baseline: a plain torch.distributed group of two, built on its own store."""
    import datetime

    import torch.distributed as dist

    prefix = dist.PrefixStore("flat/", store)
    if device.startswith("cuda"):
        import torch

        if torch.device(device).index is not None:
            torch.cuda.set_device(torch.device(device))
        return dist.ProcessGroupNCCL(prefix, rank, 2)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=120)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(prefix, rank, 2, options)


def flat_broadcast(pg, tensor) -> None:
    import torch
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    pg.broadcast([tensor], options).wait()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


# ---------------------------------------------------------------- weights.transport: fetch


def fetch_server_main(args) -> None:
    import asyncio
    import signal

    from tandem.weights.fetch import WeightServer

    async def serve() -> None:
        server = WeightServer(args.workdir, "tcp://127.0.0.1:0", streams=args.streams,
                              max_chunk_bytes=args.chunk_mib * 2**20)
        print(await server.start(), flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.close()

    asyncio.run(serve())


def fetcher_main(args) -> None:
    import asyncio

    from tandem.weights.fetch import WeightFetcher

    async def run() -> None:
        fetcher = WeightFetcher(args.dest, args.address, chunk_bytes=args.chunk_mib * 2**20,
                                window=args.window, timeout=300.0, client_name=Path(args.dest).name)
        loop = asyncio.get_running_loop()
        for round_ in range(args.repeat):
            print("ready", flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # "go"
            await fetcher.fetch(1)
            print("done", flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # "clear": forget the copy
            shutil.rmtree(Path(args.dest) / "weights", ignore_errors=True)
        await fetcher.close()

    asyncio.run(run())


def expect(proc, word: str) -> None:
    while (line := proc.stdout.readline()) and line.strip() != word:
        pass
    if not line:
        raise RuntimeError(f"a fetcher process ended before saying {word!r}")


def bench_fetch(tensors, args, workdir: Path) -> tuple[dict[str, list[float]], dict]:
    """Raw single-stream copy vs fetch to 1, 2 and 4 explorers, interleaved per round."""
    from tandem.weights import WeightPublisher, version_dir

    trainer = workdir / "trainer"
    WeightPublisher(trainer, shard_bytes=args.shard_mib * 2**20).publish(1, tensors)
    shards = sorted(version_dir(trainer, 1).glob("*.safetensors"))
    me = [sys.executable, __file__, "--chunk-mib", str(args.chunk_mib)]
    server = subprocess.Popen([*me, "--role", "fetch-server", "--workdir", str(trainer),
                               "--streams", str(args.streams)],
                              stdout=subprocess.PIPE, text=True)
    times: dict[str, list[float]] = {"raw file copy (1 stream, + fsync)": []}
    counts = (1, 2, 4)
    procs = {}
    try:
        address = server.stdout.readline().strip()
        for n in counts:
            times[f"fetch to {n} explorer{'s' if n > 1 else ''}"] = []
            procs[n] = [subprocess.Popen(
                [*me, "--role", "fetcher", "--address", address, "--window", str(args.window),
                 "--repeat", str(args.repeat), "--dest", str(workdir / f"n{n}-explorer-{i}")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(n)]
        for _ in range(args.repeat):
            copy_dir = workdir / "copy"
            copy_dir.mkdir()
            start = time.perf_counter()
            for shard in shards:
                shutil.copyfile(shard, copy_dir / shard.name)
                fd = os.open(copy_dir / shard.name, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            times["raw file copy (1 stream, + fsync)"].append(time.perf_counter() - start)
            shutil.rmtree(copy_dir)
            for n in counts:
                group = procs[n]
                for p in group:
                    expect(p, "ready")
                start = time.perf_counter()
                for p in group:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                for p in group:
                    expect(p, "done")
                times[f"fetch to {n} explorer{'s' if n > 1 else ''}"].append(
                    time.perf_counter() - start)
                for p in group:
                    p.stdin.write("clear\n")
                    p.stdin.flush()
        for group in procs.values():
            for p in group:
                p.wait(timeout=60)
    finally:
        for group in procs.values():
            for p in group:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        server.terminate()
        server.wait(timeout=30)
    info = {"shards": len(shards), "shard_bytes": args.shard_mib * 2**20,
            "chunk_bytes": args.chunk_mib * 2**20, "window": args.window,
            "streams": args.streams}
    return times, info


def fetch_report(args, tensors, nbytes: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bench-fetch-", dir=args.workdir))
    try:
        times, info = bench_fetch(tensors, args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    copy = median(times["raw file copy (1 stream, + fsync)"])
    rows = {}
    for name, ts in times.items():
        n = int(name.split()[2]) if name.startswith("fetch") else 1
        rows[name] = {"median_s": median(ts), "min_s": min(ts), "runs_s": ts,
                      "GB_per_s_per_explorer": nbytes / 1e9 / median(ts),
                      "GB_per_s_total": n * nbytes / 1e9 / median(ts),
                      "vs_raw_copy": median(ts) / copy}
    width = max(map(len, rows))
    print(f"\n{'measurement':<{width}}  {'median s':>9}  {'min s':>7}  {'GB/s each':>9}  "
          f"{'GB/s all':>8}  {'vs copy':>7}")
    for name, row in rows.items():
        print(f"{name:<{width}}  {row['median_s']:>9.3f}  {row['min_s']:>7.3f}  "
              f"{row['GB_per_s_per_explorer']:>9.2f}  {row['GB_per_s_total']:>8.2f}  "
              f"{row['vs_raw_copy']:>6.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "transport": "fetch", "bytes": nbytes, "tensors": len(tensors), "repeat": args.repeat,
        "cpus": os.cpu_count(), "load_average": os.getloadavg(), **info, "results": rows},
        indent=1))
    print(f"\nwrote {out}")


# ---------------------------------------------------------------- sender side


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_files(tensors, repeat: int, workdir: Path) -> dict[str, list[float]]:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tandem.weights import WeightPublisher, WeightSubscriber

    cpu = [(n, t.cpu()) for n, t in tensors]
    dest = {n: torch.empty_like(t) for n, t in cpu}
    state = dict(cpu)
    times: dict[str, list[float]] = {"memcpy": [], "raw safetensors write+read": [],
                                     "raw safetensors write+fsync+read": [],
                                     "checkpoint publish+load": []}

    def raw(fsync: bool) -> None:
        path = workdir / "raw.safetensors"
        save_file(state, str(path))
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                dest[name].copy_(f.get_tensor(name))

    run_dir = workdir / "run"
    publisher = WeightPublisher(run_dir, keep=1)
    subscriber = WeightSubscriber(run_dir)

    def clean(fn) -> float:
        # Untimed: remove the last raw file (truncating pages still under writeback waits for
        # the disk) and flush, so no measurement pays for the one before it.
        (workdir / "raw.safetensors").unlink(missing_ok=True)
        os.sync()
        return timed(fn)

    for i in range(repeat):
        times["memcpy"].append(clean(lambda: [t.clone() for _, t in cpu]))
        times["raw safetensors write+read"].append(clean(lambda: raw(False)))
        times["raw safetensors write+fsync+read"].append(clean(lambda: raw(True)))

        def checkpoint() -> None:
            publisher.publish(i, cpu)
            for name, t in subscriber.load(i):
                dest[name].copy_(t)

        times["checkpoint publish+load"].append(clean(checkpoint))
    shutil.rmtree(run_dir)
    return times


def shm_loader_main(args) -> None:
    """The explorer of the shared-memory rows: per round, load the version it is told into a
    preallocated model (the first round allocates it and is the warm-up) and say how long."""
    from tandem.common.logging import configure_logging
    from tandem.weights.shm import SharedMemorySubscriber

    configure_logging("shm-loader", level="warning")
    subscriber = SharedMemorySubscriber(args.workdir)
    dest = None
    for line in sys.stdin:
        version = int(line)
        start = time.perf_counter()
        pairs = subscriber.load(version)
        if dest is None:
            dest = {name: t.clone() for name, t in pairs}
        else:
            for name, t in pairs:
                dest[name].copy_(t)
        del pairs
        print(f"loaded {time.perf_counter() - start}", flush=True)


def bench_shm(tensors, repeat: int, workdir: Path) -> dict[str, list[float]]:
    """weights.transport: shared_memory, interleaved per round with its ceiling."""
    import torch

    from tandem.weights.shm import SharedMemoryPublisher

    cpu = [(n, t.cpu()) for n, t in tensors]
    dest = {n: torch.empty_like(t) for n, t in cpu}
    for name, t in cpu:  # touched once: a model's parameters are resident
        dest[name].copy_(t)
    publisher = SharedMemoryPublisher(workdir, keep=1)
    loader = subprocess.Popen(
        [sys.executable, __file__, "--role", "shm-loader", "--workdir", str(workdir),
         "--threads", str(torch.get_num_threads())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    names = ("memcpy into a preallocated copy", "shared memory publish (trainer)",
             "shared memory load (explorer process)", "shared memory publish+load")
    times: dict[str, list[float]] = {name: [] for name in names}

    def load(version: int) -> float:
        loader.stdin.write(f"{version}\n")
        loader.stdin.flush()
        while (line := loader.stdout.readline()) and not line.startswith("loaded "):
            pass
        if not line:
            raise RuntimeError(f"the shared-memory loader process ended ({loader.wait(30)})")
        return float(line.split()[1])

    try:
        for i in range(repeat + 1):  # round 0 warms both ends up and is not counted
            copy = timed(lambda: [dest[n].copy_(t) for n, t in cpu])
            publish = timed(lambda: publisher.publish(i, cpu))
            loaded = load(i)
            if i > 0:
                times[names[0]].append(copy)
                times[names[1]].append(publish)
                times[names[2]].append(loaded)
                times[names[3]].append(publish + loaded)
    finally:
        loader.stdin.close()
        loader.wait(30)
        publisher.close()
    return times


def bench_broadcast(tensors, repeat: int, bucket_bytes: int, device: str,
                    receiver_device: str) -> dict[str, list[float]]:
    import datetime

    import torch
    import torch.distributed as dist

    from tandem.weights import WeightBroadcaster

    total = sum(t.numel() for _, t in tensors)
    raw = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=120),
                        wait_for_workers=False)
    raw.set("numel", str(total))
    sender = WeightBroadcaster(device=device, bucket_bytes=bucket_bytes, timeout=120.0)
    rendezvous = sender.open_group(["bench/w0"])
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    peer = subprocess.Popen(
        [sys.executable, __file__, "--role", "receiver", "--flat-port", str(raw.port),
         "--rendezvous", rendezvous.model_dump_json(), "--repeat", str(repeat),
         "--receiver-device", receiver_device, "--threads", str(torch.get_num_threads())],
        env=env, stdout=subprocess.DEVNULL)
    label = "nccl" if device.startswith("cuda") else "gloo"
    times: dict[str, list[float]] = {f"flat {label} broadcast (torch.distributed)": [],
                                     f"tandem broadcast ({label}, buckets)": []}
    try:
        flat_pg = build_flat_group(raw, 0, device)
        flat = torch.cat([t.reshape(-1) for _, t in tensors])
        for i in range(repeat + 1):  # round 0 warms both paths up and is not counted
            stats = sender.broadcast(i, tensors)

            def flat_once() -> None:
                flat_broadcast(flat_pg, flat)
                raw.wait([f"got/{i}"], datetime.timedelta(seconds=120))

            flat_seconds = timed(flat_once)
            if i > 0:
                times[f"tandem broadcast ({label}, buckets)"].append(stats.seconds)
                times[f"flat {label} broadcast (torch.distributed)"].append(flat_seconds)
        peer.wait(120)
    finally:
        sender.close()
        if peer.poll() is None:
            peer.terminate()
            peer.wait(10)
    if peer.returncode != 0:
        raise RuntimeError(f"receiver process exited {peer.returncode}")
    return times


def bench_cuda_copy(tensors, repeat: int) -> dict[str, list[float]]:
    """Two ranks on one GPU may be refused by NCCL: then the ceiling is a device-to-device copy."""
    import torch

    flat = torch.cat([t.reshape(-1) for _, t in tensors])
    other = torch.empty_like(flat, device="cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        other.copy_(flat)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return {"CUDA-to-CUDA copy (NCCL refused two ranks on one GPU)": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000,
                        help="parameters of the synthetic model (bf16: 2 bytes each)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each measurement")
    parser.add_argument("--bucket-mib", type=int, default=512, help="broadcast bucket size")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    parser.add_argument("--out", default=".bench/weights.json", help="JSON results")
    parser.add_argument("--workdir", default=None, help="where checkpoint files go (a temp dir)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in both processes (on a small shared machine "
                             "more threads than free cores makes every copy slower and noisier)")
    parser.add_argument("--transport", default="checkpoint", choices=["checkpoint", "fetch"],
                        help="fetch: weights.transport fetch to 1, 2 and 4 explorers vs a copy")
    parser.add_argument("--chunk-mib", type=int, default=8, help="fetch: weights.fetch_chunk_bytes")
    parser.add_argument("--window", type=int, default=4, help="fetch: weights.fetch_window")
    parser.add_argument("--streams", type=int, default=8, help="fetch: weights.fetch_streams")
    parser.add_argument("--shard-mib", type=int, default=2048, help="fetch: weights.shard_bytes")
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--dest", help=argparse.SUPPRESS)
    parser.add_argument("--role", default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--flat-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--receiver-device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.role == "receiver":
        receiver_main(args)
        return
    if args.role == "shm-loader":
        shm_loader_main(args)
        return
    if args.role in ("fetch-server", "fetcher"):
        from tandem.common.logging import configure_logging

        configure_logging(args.role, level="warning")
        (fetch_server_main if args.role == "fetch-server" else fetcher_main)(args)
        return

    from tandem.common.logging import configure_logging

    configure_logging("bench", level="warning")
    receiver_device = args.device
    if args.device.startswith("cuda"):
        receiver_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    tensors = make_tensors(args.params, args.device)
    count = sum(t.numel() for _, t in tensors)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"{len(tensors)} tensors, {count / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB bf16, "
          f"repeat {args.repeat}, buckets {args.bucket_mib} MiB, device {args.device}, "
          f"{os.cpu_count()} CPUs, {args.threads} torch threads", flush=True)

    if args.transport == "fetch":
        fetch_report(args, tensors, nbytes)
        return
    workdir = Path(tempfile.mkdtemp(prefix="bench-weights-", dir=args.workdir))
    try:
        times = bench_files(tensors, args.repeat, workdir)
        if not args.device.startswith("cuda"):  # CUDA IPC handles: not written (docs/weights.md)
            times.update(bench_shm(tensors, args.repeat, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    try:
        times.update(bench_broadcast(tensors, args.repeat, args.bucket_mib * 2**20, args.device,
                                     receiver_device))
    except Exception as exc:
        if not args.device.startswith("cuda"):
            raise
        print(f"NCCL broadcast failed ({exc}); measuring CUDA-to-CUDA copies instead")
        times.update(bench_cuda_copy(tensors, args.repeat))

    rows = {name: {"median_s": median(ts), "min_s": min(ts), "runs_s": ts,
                   "GB_per_s": nbytes / 1e9 / median(ts)} for name, ts in times.items()}
    ratios = {}
    pairs = [("checkpoint publish+load", "raw safetensors write+read"),
             ("checkpoint publish+load", "raw safetensors write+fsync+read")]
    flat = next((k for k in times if k.startswith("flat")), None)
    ours = next((k for k in times if k.startswith("tandem broadcast")), None)
    if flat and ours:
        pairs.append((ours, flat))
    if "shared memory load (explorer process)" in times:
        pairs += [("shared memory load (explorer process)", "memcpy"),
                  ("shared memory load (explorer process)", "memcpy into a preallocated copy"),
                  ("shared memory publish+load", "memcpy")]
        if ours:
            pairs.append((ours, "memcpy"))
    for a, b in pairs:
        ratios[f"{a} / {b}"] = rows[a]["median_s"] / rows[b]["median_s"]

    width = max(map(len, rows))
    print(f"\n{'measurement':<{width}}  {'median s':>9}  {'min s':>7}  {'GB/s':>6}")
    for name, row in rows.items():
        print(f"{name:<{width}}  {row['median_s']:>9.3f}  {row['min_s']:>7.3f}  "
              f"{row['GB_per_s']:>6.2f}")
    print()
    for name, ratio in ratios.items():
        print(f"{ratio:5.2f}x  {name}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "params": count, "bytes": nbytes, "tensors": len(tensors), "repeat": args.repeat,
        "bucket_bytes": args.bucket_mib * 2**20, "device": args.device,
        "cpus": os.cpu_count(), "threads": args.threads, "load_average": os.getloadavg(),
        "results": rows, "ratios": ratios}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
