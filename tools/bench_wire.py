"""Wire throughput: experiences through tandem's codec and RPC vs the same bytes as raw pyzmq.

A sender process pushes batches of experiences to a receiver process over tcp loopback; the
receiver decodes them (full schema validation) and acknowledges each batch. The same run then
sends the very same frames over bare DEALER/ROUTER sockets with no codec, as the ceiling.
Prints a table (experiences/s, GB/s, ratio to raw) and writes JSON.

    python tools/bench_wire.py [--seconds 3] [--out .bench/wire.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path

import numpy as np

CASES = [  # (label, tokens per experience, experiences per message)
    ("1k tokens, batch 64", 1024, 64),
    ("32k tokens, batch 1", 32768, 1),
    ("32k tokens, batch 8", 32768, 8),
]


def make_batch(tokens: int, batch: int):
    from tandem.common.messages import Experience, PutExperiences, experience_id

    rng = np.random.default_rng(0)
    prompt = tokens // 8
    exps = [
        Experience(id=experience_id("task", i, 0, "bench"), task_id="task", group_id="task@v0",
                   tokens=rng.integers(0, 150_000, tokens, dtype=np.int32), prompt_len=prompt,
                   action_mask=np.ones(tokens - prompt, np.uint8),
                   logprobs=rng.standard_normal(tokens - prompt).astype(np.float32),
                   reward=1.0, rewards={"correct": 1.0}, policy_version=0, explorer="bench",
                   info={"group_size": batch})
        for i in range(batch)]
    return PutExperiences(experiences=exps)


def tandem_server(address_q: mp.Queue) -> None:
    from tandem.common.messages import PutExperiences, PutResult
    from tandem.common.rpc import RpcServer

    async def main():
        server = RpcServer("tcp://127.0.0.1:0", name="sink")

        @server.handler(PutExperiences)
        async def on_put(msg, ctx):
            return PutResult(stored=len(msg.experiences), duplicates=0)

        address_q.put(await server.start())
        await server.serve()

    asyncio.run(main())


def raw_server(address_q: mp.Queue) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    address_q.put(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    while True:
        frames = sock.recv_multipart(copy=False)
        sock.send_multipart([frames[0], b"ok"])


async def run_tandem(address: str, msg, seconds: float, window: int) -> tuple[int, float]:
    from tandem.common.rpc import RpcClient

    client = RpcClient(address, peer="sink")
    sent = 0
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            await asyncio.gather(*[client.call(msg) for _ in range(window)])
            sent += window
        return sent, time.perf_counter() - start
    finally:
        await client.close()


def run_raw(address: str, frames: list[bytes], seconds: float, window: int) -> tuple[int, float]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sent = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(window):
            sock.send_multipart(frames, copy=False)
        for _ in range(window):
            sock.recv_multipart()
        sent += window
    elapsed = time.perf_counter() - start
    sock.close(0)
    ctx.term()
    return sent, elapsed


def serve(target) -> tuple[mp.Process, str]:
    q: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=target, args=(q,), daemon=True)
    proc.start()
    return proc, q.get(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--window", type=int, default=8, help="messages in flight")
    parser.add_argument("--out", default=".bench/wire.json")
    args = parser.parse_args()

    from tandem.common import codec

    rows = []
    for label, tokens, batch in CASES:
        msg = make_batch(tokens, batch)
        frames = [bytes(f) for f in codec.encode_request(msg, "x")]
        nbytes = sum(len(f) for f in frames)
        tproc, taddr = serve(tandem_server)
        rproc, raddr = serve(raw_server)
        try:
            # Alternate short rounds so both see the same machine load; sum them.
            t_sent = t_time = r_sent = r_time = 0.0
            for _ in range(3):
                s, e = asyncio.run(run_tandem(taddr, msg, args.seconds / 3, args.window))
                t_sent, t_time = t_sent + s, t_time + e
                s, e = run_raw(raddr, frames, args.seconds / 3, args.window)
                r_sent, r_time = r_sent + s, r_time + e
        finally:
            for p in (tproc, rproc):
                p.terminate()
                p.join(5)
        t_exp = t_sent * batch / t_time
        r_exp = r_sent * batch / r_time
        rows.append({
            "case": label, "tokens": tokens, "batch": batch, "message_bytes": nbytes,
            "tandem_exp_per_s": t_exp, "tandem_gb_per_s": t_sent * nbytes / t_time / 1e9,
            "raw_exp_per_s": r_exp, "raw_gb_per_s": r_sent * nbytes / r_time / 1e9,
            "ratio_to_raw": t_exp / r_exp,
        })

    print(f"{'case':<22}{'tandem exp/s':>14}{'GB/s':>8}{'raw exp/s':>12}{'GB/s':>8}{'ratio':>8}")
    for r in rows:
        print(f"{r['case']:<22}{r['tandem_exp_per_s']:>14,.0f}{r['tandem_gb_per_s']:>8.2f}"
              f"{r['raw_exp_per_s']:>12,.0f}{r['raw_gb_per_s']:>8.2f}{r['ratio_to_raw']:>8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "wire", "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
