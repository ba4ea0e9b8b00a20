"""`tools/bench_explorer.py --engine vllm`: VLLMEngine against bare vLLM, in one run.

Both engines are started in this process on the same model folder with the same arguments;
only one of them runs at a time. Rounds alternate which goes first, and the ratios are medians
of per-round ratios (robust to a shared machine whose load drifts). Needs the script guard that
`tools/bench_explorer.py` has: vLLM spawns its engine core.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, enforce_eager=True,
                   kv_cache_memory_bytes=256 << 20)


def bare_load(worker, path: str) -> int:
    """Runs inside vLLM's worker: the same file's tensors straight into vLLM's own in-place
    reload (on vLLM 0.32's CPU backend a second plain `model.load_weights` fails)."""
    from safetensors.torch import load_file

    state = load_file(path)
    worker.model_runner.reload_weights(weights_iterator=state.items(), is_checkpoint_format=True)
    return len(state)


def bench_vllm(args, make_prompts) -> None:
    import os

    # `bare_load` is a function sent to the worker: vLLM pickles callables only when allowed.
    # Set before either engine core starts; the benchmark's own processes only.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import torch
    import vllm

    from tandem.explorer.sampling import SamplingParams
    from tandem.explorer.vllm_engine import VLLMEngine
    from tandem.explorer.vllm_worker import vllm_engine_kwargs
    from tandem.explorer.weights import WeightLoader
    from tandem.weights import WeightPublisher

    tmp = tempfile.TemporaryDirectory()
    model_path = args.model
    if model_path is None:
        from tandem.weights.tiny import build_tiny_model

        model_path = str(Path(tmp.name) / "model")
        build_tiny_model(model_path, hidden=128, heads=2, kv_heads=1)  # CPU attention: head_dim 64
    batches = [int(b) for b in args.batches.split(",")]
    max_tokens = args.max_tokens

    start = time.perf_counter()
    engine = VLLMEngine.from_pretrained(model_path, max_batch=max(batches), **ENGINE_ARGS)
    engine_start = time.perf_counter() - start
    start = time.perf_counter()
    bare = vllm.LLM(model=model_path, max_num_seqs=max(batches), seed=0,
                    **vllm_engine_kwargs(), **ENGINE_ARGS)
    bare_start = time.perf_counter() - start
    import sys

    import cloudpickle  # `bare_load` travels by value: the worker cannot import tools/

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        bare_params = vllm.SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                          ignore_eos=True, logprobs=0)

        def run_engine(prompts):
            return sum(len(c) for g in engine.generate_sync(prompts, 1, params) for c in g)

        def run_bare(prompts):
            ids = [{"prompt_token_ids": engine.tokenizer(p).input_ids} for p in prompts]
            outs = bare.generate(ids, bare_params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        warm = time.perf_counter()
        run_engine(make_prompts(max(batches)))
        run_bare(make_prompts(max(batches)))
        warm_s = time.perf_counter() - warm

        rows = []
        for batch in batches:
            prompts = make_prompts(batch)
            rates: dict[str, list[float]] = {"engine": [], "bare": []}
            for r in range(args.repeats):
                order = ("bare", "engine") if r % 2 == 0 else ("engine", "bare")
                for name in order:
                    t = time.perf_counter()
                    tokens = (run_engine if name == "engine" else run_bare)(prompts)
                    assert tokens == batch * max_tokens, (name, tokens)
                    rates[name].append(tokens / (time.perf_counter() - t))
            ratios = sorted(e / b for e, b in zip(rates["engine"], rates["bare"]))
            rows.append({"batch": batch, "max_tokens": max_tokens,
                         "engine_tok_s": round(statistics.median(rates["engine"]), 1),
                         "bare_tok_s": round(statistics.median(rates["bare"]), 1),
                         "ratio": round(statistics.median(ratios), 3),
                         "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3)})

        # weight updates: the same published version, through tandem and bare
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        run_dir = Path(tmp.name) / "run"
        WeightPublisher(run_dir).publish(1, model.named_parameters())
        shard = sorted((run_dir / "weights" / "v1").glob("*.safetensors"))
        loader = WeightLoader(engine, run_dir=run_dir, explorer="explorer-0", timeout=120.0)
        update = {"tandem": [], "bare": []}
        for r in range(args.repeats):
            for name in (("bare", "tandem") if r % 2 == 0 else ("tandem", "bare")):
                t = time.perf_counter()
                if name == "tandem":
                    asyncio.run(loader.load(1, "checkpoint"))
                else:
                    for path in shard:
                        bare.collective_rpc(bare_load, args=(str(path),))
                update[name].append(time.perf_counter() - t)
        asyncio.run(loader.close())
        update_ratio = statistics.median(t / b for t, b in zip(update["tandem"], update["bare"]))
    finally:
        engine.close()
        bare = None  # frees the engine

    print(f"VLLMEngine vs vllm.LLM.generate — vLLM {vllm.__version__}, "
          f"{Path(model_path).name}, {max_tokens} tokens per response, "
          f"median of {args.repeats} paired rounds")
    print(f"{'batch':>6} {'engine tok/s':>14} {'LLM.generate tok/s':>20} {'ratio':>7} "
          f"{'ratio range':>13}")
    for r in rows:
        print(f"{r['batch']:>6} {r['engine_tok_s']:>14.1f} {r['bare_tok_s']:>20.1f} "
              f"{r['ratio']:>7.3f} {r['ratio_min']:>6.2f}-{r['ratio_max']:<6.2f}")
    tandem_ms = statistics.median(update["tandem"]) * 1000
    bare_ms = statistics.median(update["bare"]) * 1000
    print(f"checkpoint weight update: WeightLoader.load {tandem_ms:.1f} ms, bare load_weights in "
          f"the worker {bare_ms:.1f} ms, ratio {update_ratio:.2f}")
    print(f"start-up: VLLMEngine.from_pretrained {engine_start:.1f} s, vllm.LLM {bare_start:.1f} s;"
          f" first generate of both (warm-up) {warm_s:.1f} s")
    out = Path(args.out or ".bench/explorer-vllm.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "explorer-vllm", "vllm": vllm.__version__, "torch": torch.__version__,
        "machine": platform.machine(), "model": str(args.model or "tiny (tandem.weights.tiny)"),
        "rows": rows,
        "weight_update_ms": {"tandem": round(tandem_ms, 1), "bare": round(bare_ms, 1),
                             "ratio": round(update_ratio, 3)},
        "startup_s": {"engine": round(engine_start, 1), "bare": round(bare_start, 1),
                      "first_generate_both": round(warm_s, 1)}}, indent=2))
    print(f"wrote {out}")
    tmp.cleanup()
