"""Generated tokens/s of TransformersEngine against a bare `model.generate` loop.

Same model, same prompts (mixed lengths, so both left-pad), same sampling (temperature 1, every
response exactly `--max-tokens` long so both generate the same number of tokens), measured side
by side in one process for `--repeats` paired rounds (alternating which goes first). The table
gives medians; the ratio is the median of each round's engine/generate ratio, which is robust to
a shared machine whose load drifts between rounds.

    .venv/bin/python tools/bench_explorer.py [--batches 1,8,64] [--max-tokens 64] [--threads 1]
                                             [--repeats 7] [--model DIR --device cuda] [--out PATH]

Without `--model` it builds the tiny test model (tandem.weights.tiny) in a temporary folder.

`--engine vllm` (in `.venv-vllm`, see `make test-vllm`) measures VLLMEngine instead, against bare
vLLM in the same run: tokens/s against `vllm.LLM.generate` on the same prompts, a checkpoint
weight update (`WeightLoader.load`: pause, workers load, prefix cache reset) against a bare
`model.load_weights` of the same file's tensors inside vLLM's worker, and start-up times.

    .venv-vllm/bin/python tools/bench_explorer.py --engine vllm [--batches 8,64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path


def make_prompts(n: int) -> list[str]:
    base = ["What is 12+30? ", "Guess the number: ", "Solve 7*6 and say why. ",
            "The quick brown fox jumps over the lazy dog, then ", "x=", "Tell me about 2+2"]
    return [base[i % len(base)] + str(i) for i in range(n)]


def bare_generate(model, tokenizer, prompts, max_tokens, device):
    """The reference: one `model.generate` call for the whole batch, left-padded."""
    import torch

    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    with torch.inference_mode():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=tokenizer.pad_token_id)
    return int((out.shape[1] - enc.input_ids.shape[1]) * out.shape[0])


def engine_generate(engine, prompts, max_tokens):
    from tandem.explorer.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    results = engine.generate_sync(prompts, 1, params)
    return sum(len(c) for group in results for c in group)


def timed(fn):
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model folder; default: build the tiny model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both (1 is steadiest on a shared box)")
    parser.add_argument("--out", default=None, help="default .bench/explorer[-vllm].json")
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    args = parser.parse_args()
    if args.engine == "vllm":
        from bench_explorer_vllm import bench_vllm

        bench_vllm(args, make_prompts)
        return
    args.out = args.out or ".bench/explorer.json"

    import torch

    torch.set_num_threads(args.threads)

    from tandem.explorer.transformers_engine import TransformersEngine

    torch.manual_seed(0)
    tmp = None
    model_path = args.model
    if model_path is None:
        from tandem.weights.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory()
        model_path = tmp.name
        build_tiny_model(model_path)
    batches = [int(b) for b in args.batches.split(",")]
    engine = TransformersEngine.from_pretrained(model_path, device=args.device,
                                                max_batch=max(batches))
    model, tokenizer = engine.model, engine.tokenizer
    # warm both paths (allocator, kernels, first-call imports)
    bare_generate(model, tokenizer, make_prompts(2), 4, args.device)
    engine_generate(engine, make_prompts(2), 4)

    rows = []
    for batch in batches:
        prompts = make_prompts(batch)
        runs = {
            "generate": lambda: bare_generate(model, tokenizer, prompts, args.max_tokens,
                                              args.device),
            "engine": lambda: engine_generate(engine, prompts, args.max_tokens),
        }
        rates: dict[str, list[float]] = {"engine": [], "generate": []}
        for r in range(args.repeats):
            # alternate which goes first, so drift in the machine's load hits both alike
            for name in (("generate", "engine") if r % 2 == 0 else ("engine", "generate")):
                tokens, seconds = timed(runs[name])
                assert tokens == batch * args.max_tokens, (name, tokens)
                rates[name].append(tokens / seconds)
        ratios = sorted(e / g for e, g in zip(rates["engine"], rates["generate"]))
        rows.append({"batch": batch, "max_tokens": args.max_tokens,
                     "engine_tok_s": round(statistics.median(rates["engine"]), 1),
                     "generate_tok_s": round(statistics.median(rates["generate"]), 1),
                     "ratio": round(statistics.median(ratios), 3),
                     "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3)})

    print(f"TransformersEngine vs model.generate — {Path(model_path).name}, "
          f"device {args.device}, {args.threads} thread(s), "
          f"{args.max_tokens} tokens per response, median of {args.repeats} paired rounds")
    print(f"{'batch':>6} {'engine tok/s':>14} {'generate tok/s':>16} {'ratio':>7} "
          f"{'ratio range':>13}")
    for r in rows:
        print(f"{r['batch']:>6} {r['engine_tok_s']:>14.1f} {r['generate_tok_s']:>16.1f} "
              f"{r['ratio']:>7.3f} {r['ratio_min']:>6.2f}-{r['ratio_max']:<6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "explorer", "device": args.device, "model": str(model_path) if args.model
        else "tiny (tandem.weights.tiny)", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(), "rows": rows}, indent=2))
    print(f"wrote {out}")
    engine.close()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
