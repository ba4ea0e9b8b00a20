"""Requests/s and generated tokens/s through the explorer's OpenAI endpoint against calling the
engine directly: same engine, same prompts, same sampling, side by side in one run.

`--concurrency` clients, each making `--requests` chat requests one after the other (as
concurrent agent episodes do), with the official `openai` client from the same process and
event loop as the endpoint, as the `agent` workflow runs them. The direct path hands the same
prompt token ids to `engine.generate` in the same order: `--requests` calls of `--concurrency`
prompts each, as a workflow rolling out the same episodes would. Every response is exactly
`--max-tokens` long (the endpoint's default sampling ignores eos), so both generate the same
number of tokens. Rounds are paired and alternate which path goes first; the table gives
medians, and the ratio is the median of each round's endpoint/direct tokens/s ratio. The
`outside` columns send the same load from a second process (clients elsewhere).

Time to first token: `--concurrency` clients each send one chat request at once, streamed
(`stream=True, logprobs=True`: the clock stops at the first chunk carrying a sampled token, not
at the role chunk sent before generation) and not streamed (the clock stops at the whole
answer, the first moment a client has any token); medians and 90th percentiles over
`--repeats` rounds, the two alternating which goes first. `--only ttft` runs this part alone.

    .venv/bin/python tools/bench_openai.py [--size tiny|small] [--concurrency 1,8,32,64]
                                           [--requests 3] [--only both|throughput|ttft]
                                           [--max-batch 32] [--max-tokens 64] [--repeats 5]
                                           [--threads 1] [--out .bench/openai.json]

Without `--model` it builds the tiny test model (tandem.weights.tiny) and gives it a minimal
chat template.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def questions(n: int) -> list[str]:
    base = ["What is 12+30?", "Guess the number.", "Solve 7*6 and say why.",
            "The quick brown fox jumps over the lazy dog, then what?", "x=?", "Tell me 2+2"]
    return [f"{base[i % len(base)]} {i}" for i in range(n)]


async def through_endpoint(client, prompts: list[list[str]],
                           max_tokens: int) -> tuple[int, float]:
    async def agent(mine: list[str]) -> int:
        tokens = 0
        for p in mine:
            reply = await client.chat.completions.create(
                model="policy", max_tokens=max_tokens, messages=[{"role": "user", "content": p}])
            tokens += reply.usage.completion_tokens
        return tokens

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(agent(list(col)) for col in zip(*prompts)))
    return sum(tokens), time.perf_counter() - t0


class ClientProcess:
    """The same load from another process (`--serve-client`): clients elsewhere, as an outside
    user of an `openai.enabled` endpoint would be; it keeps its imports warm between rounds."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve-client", self.url, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)

    async def __call__(self, prompts: list[list[str]], max_tokens: int) -> tuple[int, float]:
        self.proc.stdin.write((json.dumps({"prompts": prompts, "max_tokens": max_tokens})
                               + "\n").encode())
        await self.proc.stdin.drain()
        while True:  # skip whatever else the child printed (a library's warning)
            line = await asyncio.wait_for(self.proc.stdout.readline(), 600)
            if not line:
                raise RuntimeError("the client process died; see its stderr above")
            if line.startswith(b"result "):
                tokens, seconds = json.loads(line[len(b"result "):])
                return tokens, seconds

    async def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            await asyncio.wait_for(self.proc.wait(), 30)


async def serve_client(url: str) -> None:
    """The child's side of `ClientProcess`: one JSON line in, (tokens, seconds) out."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        job = json.loads(line)
        result = await through_endpoint(client, job["prompts"], job["max_tokens"])
        sys.stdout.write("result " + json.dumps(result) + "\n")
        sys.stdout.flush()
    await client.close()


async def first_token(client, prompt: str, max_tokens: int, stream: bool) -> float:
    """Seconds until the client holds the answer's first sampled token."""
    messages = [{"role": "user", "content": prompt}]
    t0 = time.perf_counter()
    if not stream:
        await client.chat.completions.create(model="policy", max_tokens=max_tokens,
                                             messages=messages)
        return time.perf_counter() - t0
    seconds = None
    async for chunk in await client.chat.completions.create(
            model="policy", max_tokens=max_tokens, messages=messages, stream=True,
            logprobs=True):
        if seconds is None and chunk.choices and chunk.choices[0].logprobs is not None:
            seconds = time.perf_counter() - t0
    assert seconds is not None, "the stream carried no token"
    return seconds


async def ttft_rows(client, levels: list[int], repeats: int, max_tokens: int) -> list[dict]:
    rows = []
    for n in levels:
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(repeats):
            for stream in ((True, False) if r % 2 == 0 else (False, True)):
                times[stream] += await asyncio.gather(*(
                    first_token(client, p, max_tokens, stream) for p in questions(n)))

        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)

        rows.append({"concurrency": n, "max_tokens": max_tokens, "requests": n * repeats,
                     "streamed_ttft_ms_median": round(statistics.median(times[True]) * 1000, 1),
                     "streamed_ttft_ms_p90": pct(times[True], 0.9),
                     "whole_ttft_ms_median": round(statistics.median(times[False]) * 1000, 1),
                     "whole_ttft_ms_p90": pct(times[False], 0.9),
                     "speedup": round(statistics.median(times[False])
                                      / statistics.median(times[True]), 2)})
    return rows


async def direct(engine, prompt_ids: list[list[list[int]]], sampling) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = 0
    for batch in prompt_ids:
        out = await engine.generate(batch, 1, sampling)
        tokens += sum(len(c[0]) for c in out)
    return tokens, time.perf_counter() - t0


async def run(args, engine, model_name: str) -> tuple[list[dict], list[dict]]:
    import openai

    from tandem.common.config.explorer import OpenAIConfig
    from tandem.explorer.openai_server import OpenAIEndpoint
    from tandem.explorer.sampling import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    endpoint = OpenAIEndpoint(OpenAIConfig(max_concurrency=max(levels)), engine,
                              sampling=sampling, context=None, name="bench")
    await endpoint.start()
    client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="bench", max_retries=0,
                                timeout=600)
    outside = ClientProcess(endpoint.url, args.max_tokens)
    await outside.start()
    tok = engine.tokenizer
    rows: list[dict] = []
    ttft: list[dict] = []
    try:
        await through_endpoint(client, [questions(2)], 4)  # warm every path
        await outside([questions(2)], 4)
        await direct(engine, [[[5, 6, 7]]], SamplingParams(max_tokens=4))
        await first_token(client, "warm", 4, True)
        if args.only in ("both", "ttft"):
            ttft = await ttft_rows(client, levels, args.repeats, args.max_tokens)
        for n in levels if args.only in ("both", "throughput") else []:
            # prompts[r][i]: client i's r-th request
            flat = questions(n * args.requests)
            prompts = [flat[r * n:(r + 1) * n] for r in range(args.requests)]
            ids = []
            for row in prompts:
                enc = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                               add_generation_prompt=True) for p in row]
                ids.append([list(i["input_ids"]) if hasattr(i, "keys") else list(i)
                            for i in enc])
            paths = {"endpoint": lambda: through_endpoint(client, prompts, args.max_tokens),
                     "outside": lambda: outside(prompts, args.max_tokens),
                     "direct": lambda: direct(engine, ids, sampling)}
            rates: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
            for r in range(args.repeats):
                order = ["direct", "endpoint", "outside"]
                for name in order[r % 3:] + order[:r % 3]:
                    tokens, seconds = await paths[name]()
                    assert tokens == n * args.requests * args.max_tokens, (name, tokens)
                    rates[name].append((n * args.requests / seconds, tokens / seconds))
            ratios = sorted(e[1] / d[1] for e, d in zip(rates["endpoint"], rates["direct"]))
            outside_ratios = sorted(e[1] / d[1] for e, d in zip(rates["outside"],
                                                                 rates["direct"]))
            rows.append({
                "concurrency": n, "requests": args.requests, "max_tokens": args.max_tokens,
                "endpoint_req_s": round(statistics.median(x[0] for x in rates["endpoint"]), 2),
                "endpoint_tok_s": round(statistics.median(x[1] for x in rates["endpoint"]), 1),
                "direct_req_s": round(statistics.median(x[0] for x in rates["direct"]), 2),
                "direct_tok_s": round(statistics.median(x[1] for x in rates["direct"]), 1),
                "ratio": round(statistics.median(ratios), 3),
                "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3),
                "outside_tok_s": round(statistics.median(x[1] for x in rates["outside"]), 1),
                "outside_ratio": round(statistics.median(outside_ratios), 3),
                "engine_batches": endpoint.batcher.batches})
    finally:
        await client.close()
        await outside.close()
        await endpoint.close()
    return rows, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model folder with a chat template; default: tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"],
                        help="the built model: tiny (hidden 64, 2 layers) or small (hidden 512, "
                             "8 layers, ~27M parameters: per-token cost closer to a real model)")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--requests", type=int, default=3, help="requests per client, in turn")
    parser.add_argument("--max-batch", type=int, default=32, help="engine.max_batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 is steadiest on a shared box)")
    parser.add_argument("--only", default="both", choices=["both", "throughput", "ttft"])
    parser.add_argument("--out", default=".bench/openai.json")
    parser.add_argument("--serve-client", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_client:
        asyncio.run(serve_client(args.serve_client))
        return

    import torch

    torch.set_num_threads(args.threads)
    from tandem.explorer.transformers_engine import TransformersEngine

    tmp = None
    model_path = args.model
    if model_path is None:
        from tandem.weights.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory()
        model_path = tmp.name
        sizes = {"tiny": {}, "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4,
                                      "intermediate": 1408}}
        build_tiny_model(model_path, **sizes[args.size])
    engine = TransformersEngine.from_pretrained(model_path, device=args.device,
                                                max_batch=args.max_batch)
    if not getattr(engine.tokenizer, "chat_template", None):
        engine.tokenizer.chat_template = TEMPLATE
    try:
        rows, ttft = asyncio.run(run(args, engine, Path(model_path).name))
    finally:
        engine.close()
        if tmp is not None:
            tmp.cleanup()

    if ttft:
        print(f"Time to first token, streamed (stream + logprobs) vs whole answers — "
              f"{args.max_tokens} tokens per response, {args.repeats} rounds, ms")
        print(f"{'concurrent':>10} {'streamed median':>16} {'streamed p90':>13} "
              f"{'whole median':>13} {'whole p90':>10} {'whole/streamed':>15}")
        for r in ttft:
            print(f"{r['concurrency']:>10} {r['streamed_ttft_ms_median']:>16.1f} "
                  f"{r['streamed_ttft_ms_p90']:>13.1f} {r['whole_ttft_ms_median']:>13.1f} "
                  f"{r['whole_ttft_ms_p90']:>10.1f} {r['speedup']:>15.2f}")
    if rows:
        print(f"OpenAI endpoint vs engine.generate — {args.size if args.model is None else model_path}, "
              f"device {args.device}, {args.threads} thread(s), engine max_batch {args.max_batch}, "
              f"{args.requests} requests per client, {args.max_tokens} tokens per response, "
              f"median of {args.repeats} paired rounds")
        print(f"{'concurrent':>10} {'endpoint req/s':>15} {'endpoint tok/s':>15} "
              f"{'direct req/s':>13} {'direct tok/s':>13} {'ratio':>7} {'ratio range':>13} "
              f"{'outside tok/s':>14} {'ratio':>7}")
        for r in rows:
            print(f"{r['concurrency']:>10} {r['endpoint_req_s']:>15.2f} {r['endpoint_tok_s']:>15.1f} "
                  f"{r['direct_req_s']:>13.2f} {r['direct_tok_s']:>13.1f} {r['ratio']:>7.3f} "
                  f"{r['ratio_min']:>6.2f}-{r['ratio_max']:<6.2f} {r['outside_tok_s']:>14.1f} "
                  f"{r['outside_ratio']:>7.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "openai", "device": args.device,
        "model": model_path if args.model else f"{args.size} (tandem.weights.tiny)",
        "torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
        "rows": rows, "ttft": ttft}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
