"""The GPU script's checks of tandem's device path, one subcommand each (`tools/gpu/run.sh`).

    python tools/gpu/checks.py deps                       # tandem's requirements all installed
    python tools/gpu/checks.py train-sync --device cuda   # trainer, checkpoint sync, engine
    python tools/gpu/checks.py build-model --shape 0.5b-shaped --layers 24 --dest DIR

`build-model` writes a randomly initialised Qwen2.5-shaped model (bench_trainer's shapes) with
the tiny model's character tokenizer, for the engine benchmark on a 0.5B model.

`train-sync` on the tiny model: the trainer (`Learner`, bf16 autocast, `trainer.parallel: fsdp`
in one process, FSDP2 on one device) takes `--steps` GRPO steps; its weights are published as a
checkpoint version (`WeightPublisher`, in `model.dtype` bf16, each tied weight once, as
`Trainer.policy_weights` does) and a `TransformersEngine` on the same device loads that version
through `WeightSubscriber` and generates. Each claim is checked, not assumed: parameters stay
fp32 and sharded (DTensor) on the device, the loss is finite and the weights moved, every
engine parameter equals the published tensor, generation returns the asked-for tokens. Prints
one JSON line of what it measured (and writes it to `--out`); exits 1 naming the first claim
that failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# distributions the checks need, with the extras tandem up's quickstart path installs
TANDEM = ["tandem-common[fast]", "tandem-weights", "tandem-master[quickstart]", "tandem-buffer",
          "tandem-explorer", "tandem-trainer", "tandem-reward"]


class CheckFailed(Exception):
    """A claim about the device path did not hold."""


def check(ok: bool, claim: str) -> None:
    if not ok:
        raise CheckFailed(claim)


def deps(_args) -> dict:
    """Every requirement of tandem's packages (their markers and named extras) is installed at a
    version it accepts: the wheelhouse filled what the image lacks and the image's torch and
    transformers are ones tandem takes."""
    from importlib import metadata

    from packaging.requirements import Requirement

    missing, seen, todo = [], {}, [Requirement(r) for r in TANDEM]
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        extras = set(req.extras)
        if key in seen and extras <= seen[key]:
            continue
        seen[key] = seen.get(key, set()) | extras
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            missing.append(f"{req} (installed {dist.version})")
        if not key.startswith("tandem-"):
            continue  # the image's own packages are taken as they come
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in
                                         extras | {""}):
                todo.append(sub)
    check(not missing, "requirements not met: " + "; ".join(sorted(missing)))
    import torch
    import transformers

    return {"check": "deps", "packages": len(seen), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0],
            "cuda": torch.cuda.is_available(),
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def experiences(tokenizer, groups: int, per_group: int):
    import numpy as np

    from tandem.common.messages.experience import Experience, experience_id, group_id

    out = []
    for g in range(groups):
        prompt = tokenizer(f"rev {100 + g}=")["input_ids"]
        for i in range(per_group):
            response = tokenizer(str(i * 7 + g))["input_ids"]
            out.append(Experience(
                id=experience_id(f"t{g}", i, 0, "gpu"), task_id=f"t{g}",
                group_id=group_id(f"t{g}", 0), tokens=np.array(prompt + response, dtype=np.int32),
                prompt_len=len(prompt), action_mask=np.ones(len(response), dtype=np.uint8),
                logprobs=np.full(len(response), -3.0, dtype=np.float32),
                reward=float(i % 2), policy_version=0))
    return out


def train_sync(args) -> dict:
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer

    from tandem.common.config import RunConfig
    from tandem.explorer.sampling import SamplingParams
    from tandem.explorer.transformers_engine import TransformersEngine
    from tandem.trainer import distributed
    from tandem.trainer.learner import Learner
    from tandem.weights import WeightPublisher, WeightSubscriber, model_dtype
    from tandem.weights.tiny import build_tiny_model

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, run_dir = Path(tmp) / "model", Path(tmp) / "run"
        build_tiny_model(model_dir)
        config = RunConfig.model_validate({
            "model": {"path": str(model_dir), "dtype": "bfloat16"}, "run_dir": str(run_dir),
            "trainer": {"device": args.device, "precision": "bf16", "parallel": "fsdp",
                        "micro_batch_tokens": 256, "lr": 1e-3, "tensorboard": False}})
        batch = experiences(AutoTokenizer.from_pretrained(str(model_dir)), 4, 8)
        learner = Learner(config)
        try:
            check(learner.mode == "fsdp", f"trainer.parallel fsdp gave mode {learner.mode}")
            before = {n: t.clone() for n, t in learner.policy_state_dict().items()}
            start = time.perf_counter()
            metrics = [learner.step(batch) for _ in range(args.steps)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = (time.perf_counter() - start) / args.steps
            params = list(learner.actor.parameters())
            check(all(isinstance(p, DTensor) for p in params), "parameters are not sharded")
            check(all(p.dtype == torch.float32 and p.device.type == device.type
                      for p in params), f"parameters are not fp32 on {device.type}")
            check(all(torch.isfinite(torch.tensor(v)) for m in metrics for v in m.values()),
                  f"a metric is not finite: {metrics[-1]}")
            after = learner.policy_state_dict()
            check(any(not torch.equal(before[n], after[n]) for n in after),
                  "no weight moved in training")
            # as Trainer.policy_weights: HF names, model.dtype, each tied weight once
            tied = learner.actor.model.config.tie_word_embeddings
            published = [(n, t.to(model_dtype(config.model.dtype))) for n, t in after.items()
                         if not (tied and n == "lm_head.weight")]
            saved = learner.save_checkpoint(run_dir / "checkpoints")
            check((saved / "model" / "model.safetensors").is_file(), "no checkpoint written")
        finally:
            learner.release()
            distributed.shutdown()

        start = time.perf_counter()
        WeightPublisher(run_dir).publish(1, published)
        publish_s = time.perf_counter() - start
        engine = TransformersEngine.from_pretrained(model_dir, device=args.device,
                                                    dtype="bfloat16", max_batch=8)
        try:
            start = time.perf_counter()
            loaded = engine.load_weights(WeightSubscriber(run_dir).load(1), 1)
            if device.type == "cuda":
                torch.cuda.synchronize()
            load_s = time.perf_counter() - start
            check(loaded == len(published), f"engine loaded {loaded} of {len(published)}")
            mine = dict(engine.model.named_parameters())
            for name, tensor in published:
                got = mine[name]
                check(got.device.type == device.type, f"engine's {name} is on {got.device}")
                check(torch.equal(got.detach().cpu(), tensor), f"engine's {name} differs")
            start = time.perf_counter()
            out = engine.generate_sync(["rev 123=", "rev 456="], 2,
                                       SamplingParams(temperature=1.0, max_tokens=8,
                                                      ignore_eos=True))
            generate_s = time.perf_counter() - start
            check(all(len(c) == 8 for group in out for c in group),
                  "generation did not return 8 tokens per response")
        finally:
            engine.close()
    return {"check": "train-sync", "device": args.device, "steps": args.steps,
            "loss": metrics[-1].get("loss/policy"), "step_seconds": round(step_s, 4),
            "publish_seconds": round(publish_s, 4), "load_seconds": round(load_s, 4),
            "generate_seconds": round(generate_s, 4), "tensors": len(published)}


def build_model(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_trainer import SHAPES, build_model as build_shaped

    from tandem.weights.tiny import build_tiny_model

    dest = Path(args.dest)
    check(args.shape in SHAPES, f"--shape {args.shape}: one of {', '.join(SHAPES)}")
    build_shaped(args.shape, dest, args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        _, tokenizer = build_tiny_model(Path(tmp))
        tokenizer.save_pretrained(str(dest))
    return {"check": "build-model", "shape": args.shape, "layers": args.layers, "dest": str(dest)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("deps", help="tandem's requirements all installed")
    ts = sub.add_parser("train-sync", help="trainer (bf16, FSDP2), checkpoint sync, engine")
    ts.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    ts.add_argument("--steps", type=int, default=3)
    bm = sub.add_parser("build-model", help="a Qwen2.5-shaped model with the tiny tokenizer")
    bm.add_argument("--shape", default="0.5b-shaped")
    bm.add_argument("--layers", type=int, default=24)
    bm.add_argument("--dest", required=True)
    for p in sub.choices.values():
        p.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()

    from tandem.common.logging import configure_logging

    configure_logging("gpu-checks", level="warning")
    if args.command != "deps":
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    try:
        result = {"deps": deps, "train-sync": train_sync,
                  "build-model": build_model}[args.command](args)
    except CheckFailed as exc:
        sys.exit(f"checks.py {args.command}: {exc}")
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
