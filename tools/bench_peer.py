"""tandem against Hugging Face TRL's `GRPOTrainer` on the same work (issue 27 item 1).

    make bench-peer        # builds .venv-trl (TRL 1.16.0), then runs this with defaults
    .venv/bin/python tools/bench_peer.py [--trl-python .venv-trl/bin/python] [--steps 60]
        [--seeds 0,1,2] [--rows trl,synchronous,one_step_off_policy,fully_async]
        [--threads N] [--interval 0.25] [--out .bench/bench_peer.json] [--quick]

The work: the quickstart's (`tandem quickstart`): its SFT-warm-started tiny Qwen2 and character
tokenizer (`tandem.master.quickstart.prepare`, built once under `--out`'s folder with seed 0),
its training prompts (reverse three digits), its held-out 100 prompts and its reward (the `k12`
short-answer check, `tandem.reward.functions.k12`, which the TRL side calls as its reward
function). Rows: TRL (one process, run by `--trl-python`, TRL's own venv: `make bench-peer`
builds it), and `tandem up` with the presets synchronous, one_step_off_policy and fully_async
(the quickstart's config). Every seed runs every row before the next seed starts (interleaved),
so each comparison is between runs minutes apart on a shared machine.

Matched on both sides (`MATCHED`, from which both config builders read; tests/tools checks
them): 16 prompts x 8 samples per optimiser step, 6 new tokens, temperature 1, top-p 1, no
top-k, learning rate 3e-4 held constant (TRL's linear schedule overridden), AdamW betas
(0.9, 0.999), eps 1e-8, no weight decay (torch's AdamW on both: TRL's fused default overridden),
gradient-norm clip 1.0, PPO clip 0.2 both sides, no KL term and no reference model, one update
per batch (no PPO epochs, no mini-batches), the loss averaged over every completion token of the
batch (tandem `aggregation: token_mean`, TRL `loss_type: dapo`), group-normalised advantages
with the unbiased std plus 1e-4 (TRL's fixed epsilon; tandem's `std_eps` set to it), fp32 (TRL's
bf16 default overridden), no gradient checkpointing (TRL's default overridden), no entropy
bonus, the same number of optimiser steps and the seed.

Not matched (`UNMATCHED`, each with why): the order of the prompts and the sampling random
streams (each framework's own sampler; the seed is the same, the sequence is not); the ratio's
denominator (TRL takes the current policy's logprobs, so its ratio is exactly 1; tandem takes
the engine's, the same weights in synchronous, numerically close; one_step_off_policy and
fully_async train on older versions by design); threads (by default each framework's own:
TRL's one process takes every core, tandem's placement `auto` gives synchronous's two sides
every core and the asynchronous presets' one core each; `--threads N` sets N on both sides);
start-up (excluded from the timing on both sides, reported apart).

Reported per run: s/step and tokens/s (prompt + completion tokens trained, per second) over the
training phase, from the first rollout to the last update: on the tandem side from the run's
trace (first `rollout` span start to last `train` span end), on the TRL side from a
`TrainerCallback` (first `on_step_begin`, which precedes the step's generation, to last
`on_step_end`); held-out accuracy, greedy and sampled (temperature 1, 4 samples), of each saved
model and of the starting model, by tandem's own evaluation (`tandem.explorer.eval_cli
.evaluate_model`, what `tandem eval --checkpoint` runs), so both sides are scored by the same
code; peak PSS of the whole process tree (the run's root process and every descendant), summed
from /proc/<pid>/smaps_rollup every `--interval` seconds (a poll: both sides are sampled the same
way), and the PSS per process at that peak. Prints a table (mean and range over seeds) and writes
JSON. 60 steps by default (the issue used 150): a full invocation took 37 minutes on 2 cores at
load average 8-12, most of it the two-thread runs (TRL's and synchronous's, 3-7 s a step there);
with `--threads 1` a run takes about a minute. `--quick` is a smoke check (4 steps, seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

REPO = Path(__file__).resolve().parents[1]
TANDEM = str(Path(sys.executable).parent / "tandem")
PRESETS = ("synchronous", "one_step_off_policy", "fully_async")
ROWS = ("trl", *PRESETS)
MiB = 2**20

# The settings both sides run with; each builder below reads them from here.
MATCHED: dict[str, Any] = {
    "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 6, "temperature": 1.0,
    "top_p": 1.0, "top_k": 0, "lr": 3e-4, "betas": (0.9, 0.999), "adam_eps": 1e-8,
    "weight_decay": 0.0, "max_grad_norm": 1.0, "clip": 0.2, "kl_coef": 0.0, "std_eps": 1e-4,
    "entropy_coef": 0.0,
}
UNMATCHED: dict[str, str] = {
    "prompt order and sampling streams": "each framework's own sampler and generator; the seed "
                                         "is the same, the sequences are not",
    "ratio denominator": "TRL detaches the current policy's logprobs (ratio exactly 1 on its one "
                         "update); tandem uses the engine's, the same weights in synchronous",
    "staleness": "one_step_off_policy and fully_async train on rollouts of older versions: the "
                 "schedule under test",
    "threads": "by default each framework's own: TRL's one process takes every core; tandem's "
               "placement auto gives synchronous's trainer and explorer every core (they "
               "alternate) and the asynchronous presets' one core each; --threads N sets N "
               "on both sides",
    "generation code": "TRL calls transformers' generate; tandem's transformers engine runs its "
                       "own decode loop (prefill once per prompt, KV cache) on the same model",
}


# -- the two configs (pure: tests/tools/test_bench_peer.py) ------------------------------------


def tandem_config(run_dir: Path, cache: Path, *, preset: str, seed: int, steps: int,
                  threads: int | None = None) -> dict[str, Any]:
    """The quickstart's `tandem up` config for `preset`, with every `MATCHED` setting spelled out,
    no in-run evaluation (the saved model is evaluated after), and the ports and liveness a
    shared machine needs; `threads`: the trainer's and each explorer's (default: placement
    auto's choice)."""
    from tandem.common.sync import preset_explorers
    from tandem.master.quickstart import quickstart_config

    m = MATCHED
    explorers = preset_explorers(preset)
    config = quickstart_config(run_dir, cache / "model-sft", cache / "data" / "train.jsonl",
                               preset=preset, steps=steps, seed=seed, explorers=explorers,
                               lr=m["lr"]).model_dump(mode="json")
    for e in config["explorers"]:
        e["batch_size"] = m["prompts_per_step"] // explorers
        e["repeat_times"] = m["group_size"]
        e["sampling"].update(temperature=m["temperature"], top_p=m["top_p"], top_k=m["top_k"],
                             max_tokens=m["max_new_tokens"])
    config["trainer"].update(
        groups_per_step=m["prompts_per_step"], lr=m["lr"], betas=list(m["betas"]),
        adam_eps=m["adam_eps"], weight_decay=m["weight_decay"], schedule="constant",
        warmup_steps=0, max_grad_norm=m["max_grad_norm"], clip_low=m["clip"],
        clip_high=m["clip"], std_eps=m["std_eps"], entropy_coef=m["entropy_coef"],
        precision="fp32", gradient_checkpointing=False, advantage="grpo", loss="ppo_clip",
        aggregation="token_mean", ppo_epochs=1, mini_batches=1, dynamic_sampling=False)
    config["trainer"]["kl"]["coef"] = m["kl_coef"]
    config["transport"]["liveness"] = 60  # a loaded machine otherwise declares a busy peer dead
    config["logging"]["metrics"]["port"] = 0  # other runs may hold the fixed ports
    config["up"]["timeline"] = False  # drawn after the run, beside the next one
    if threads:
        config["placement"]["trainer"]["threads"] = threads
        config["placement"]["explorers"]["threads"] = threads
    return config


def trl_settings(out_dir: Path, *, seed: int, steps: int) -> dict[str, Any]:
    """`GRPOConfig`'s keyword arguments: `MATCHED`, and TRL's defaults that differ from tandem's
    (bf16, gradient checkpointing, fused AdamW, linear schedule) overridden."""
    m = MATCHED
    return {
        "output_dir": str(out_dir), "seed": seed, "max_steps": steps, "use_cpu": True,
        "bf16": False, "fp16": False, "gradient_checkpointing": False,
        "optim": "adamw_torch", "learning_rate": m["lr"], "adam_beta1": m["betas"][0],
        "adam_beta2": m["betas"][1], "adam_epsilon": m["adam_eps"],
        "weight_decay": m["weight_decay"], "lr_scheduler_type": "constant", "warmup_steps": 0,
        "max_grad_norm": m["max_grad_norm"],
        # one optimiser step per generation batch of prompts x group, trained in one pass
        "per_device_train_batch_size": m["prompts_per_step"] * m["group_size"],
        "gradient_accumulation_steps": 1, "steps_per_generation": 1, "num_iterations": 1,
        "num_generations": m["group_size"], "max_completion_length": m["max_new_tokens"],
        "temperature": m["temperature"], "top_p": m["top_p"], "top_k": m["top_k"],
        "epsilon": m["clip"], "epsilon_high": m["clip"], "beta": m["kl_coef"],
        "entropy_coef": m["entropy_coef"], "loss_type": "dapo", "scale_rewards": "group",
        "mask_truncated_completions": False,
        "logging_steps": 1, "report_to": "none", "save_strategy": "no",
        "disable_tqdm": True, "dataloader_num_workers": 0,
    }


# -- the TRL side (runs in TRL's venv: `bench_peer.py trl-worker ...`) -------------------------


def trl_worker(argv: list[str]) -> int:
    """Train with GRPOTrainer, save the model to --out/model, the step times and logs to
    --out/timing.json."""
    parser = argparse.ArgumentParser(prog="bench_peer.py trl-worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    started = time.time()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tandem.common.config import RewardConfig
    from tandem.common.messages.reward import ScoreItem
    from tandem.reward.functions.k12 import K12Reward
    from tandem.weights.hf import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    check = K12Reward(RewardConfig())

    def k12(completions: list[str], truth: list[dict], **_: Any) -> list[float]:
        return [check.score(ScoreItem(response=c, truth=t)).score
                for c, t in zip(completions, truth)]

    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "truth": r["truth"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # as tandem loads it: AutoTokenizer would rebuild the character vocabulary as a Qwen2
    # byte-level one and no answer would ever score (tandem.weights.hf.load_tokenizer)
    tokenizer = load_tokenizer(args.model)

    class Timing(TrainerCallback):
        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.begins.append(time.time())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.time())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None,
                   **__: Any) -> None:
            self.logs.append(dict(logs or {}))

    timing = Timing()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=k12,
                          train_dataset=dataset, callbacks=[timing],
                          args=GRPOConfig(**trl_settings(out / "trainer", seed=args.seed,
                                                         steps=args.steps)))
    trainer.train()
    trainer.save_model(str(out / "model"))
    tokens = [log["num_tokens"] for log in timing.logs if "num_tokens" in log]
    (out / "timing.json").write_text(json.dumps({
        "trl": trl.__version__, "started": started, "step_begins": timing.begins,
        "step_ends": timing.ends, "num_tokens": tokens[-1] if tokens else None,
        "rewards": [log["reward"] for log in timing.logs if "reward" in log],
        "threads": torch.get_num_threads()}))
    return 0


# -- measuring -----------------------------------------------------------------------------------


def tree_pss(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (name, PSS bytes) of `root` and every descendant, read from smaps_rollup."""
    import psutil

    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            text = Path(f"/proc/{p.pid}/smaps_rollup").read_text()
            name = role(p.cmdline())
        except (OSError, psutil.Error):
            continue  # exited between the listing and the read
        for line in text.splitlines():
            if line.startswith("Pss:"):
                out[p.pid] = (name, int(line.split()[1]) * 1024)
                break
    return out


def role(cmdline: list[str]) -> str:
    """A process's part in the run, from its command line."""
    line = " ".join(cmdline)
    if "trl-worker" in line:
        return "trl"
    if "-m tandem." in line:  # a module run as a process: tandem.reward.worker, a zygote
        return line.split("-m tandem.", 1)[1].split()[0].rsplit(".", 1)[-1].replace(
            "worker", "reward-worker")
    for name in ("explorer", "trainer", "buffer", "reward", "master"):
        if f"tandem-{name}" in line:
            return name
    if " up " in f" {line} ":
        return "up"
    return os.path.basename(cmdline[0]) if cmdline else "?"


class PeakPss:
    """Polls a process tree's PSS in a thread; keeps the largest sum and its per-process split."""

    def __init__(self, pid: int, interval: float):
        self.pid, self.interval = pid, interval
        self.peak, self.split, self.samples = 0, {}, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(timeout=30)

    def _poll(self) -> None:
        while not self._done.is_set():
            sample = tree_pss(self.pid)
            self.samples += 1
            total = sum(b for _, b in sample.values())
            if total > self.peak:
                self.peak, self.split = total, sample
            self._done.wait(self.interval)

    def by_process(self) -> list[tuple[str, float]]:
        return sorted(((name, round(b / MiB, 1)) for name, b in self.split.values()),
                      key=lambda x: -x[1])


def phase_breakdown(spans: list[dict[str, Any]]) -> dict[str, float]:
    """Where a tandem run's training phase (first rollout start to last train end) went, in
    seconds: the trainer training, an explorer rolling out, both at once, neither (barriers,
    sample/ack, weight publish and load, between spans), and the publish (trainer `sync`) and
    load (explorer `sync`) spans inside it."""
    trains = [(s["start"], s["end"]) for s in spans if s["kind"] == "train"
              and s["component"] == "trainer"]
    rollouts = [(s["start"], s["end"]) for s in spans if s["kind"] == "rollout"]
    start, end = min(a for a, _ in rollouts), max(b for _, b in trains)

    def covered(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        merged: list[list[float]] = []
        for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
            if b <= a:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return [(a, b) for a, b in merged]

    def length(intervals: list[tuple[float, float]]) -> float:
        return sum(b - a for a, b in intervals)

    train, rollout = covered(trains), covered(rollouts)
    either = length(covered(train + rollout))
    both = length(train) + length(rollout) - either
    syncs = {c: sum(s["end"] - s["start"] for s in spans if s["kind"] == "sync"
                    and (s["component"] == "trainer") == (c == "publish")
                    and start <= s["start"] <= end) for c in ("publish", "load")}
    return {"phase": end - start, "train": length(train), "rollout": length(rollout),
            "both": both, "neither": end - start - either, **syncs}


def run_process(argv: list[str], *, interval: float, timeout: float, log: Path
                ) -> tuple[int, float, PeakPss]:
    """Run argv to its end with its tree's PSS polled; (exit code, wall seconds, the poll)."""
    from resume_check import kill_everything  # tools/ is the script's folder

    started = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        with PeakPss(proc.pid, interval) as peak:
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_everything(proc)
                code = 124
    return code, time.monotonic() - started, peak


def run_trl(root: Path, cache: Path, *, seed: int, steps: int, trl_python: str,
            threads: int | None, interval: float, timeout: float) -> dict[str, Any]:
    out = root / f"s{seed}-trl"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = [trl_python, str(Path(__file__).resolve()), "trl-worker",
            "--model", str(cache / "model-sft"), "--train", str(cache / "data" / "train.jsonl"),
            "--out", str(out), "--seed", str(seed), "--steps", str(steps)]
    argv += ["--threads", str(threads)] if threads else []
    code, wall, peak = run_process(argv, interval=interval, timeout=timeout, log=out / "log.txt")
    if code != 0:
        raise SystemExit(f"TRL seed {seed} exited {code}; see {out / 'log.txt'}")
    t = json.loads((out / "timing.json").read_text())
    phase = t["step_ends"][-1] - t["step_begins"][0]
    return {"row": "trl", "seed": seed, "version": t["trl"], "steps": len(t["step_ends"]),
            "phase_s": phase, "s_per_step": phase / len(t["step_ends"]),
            "tokens_per_s": (t["num_tokens"] or 0) / phase, "wall_s": wall,
            "outside_s": wall - phase, "threads": t["threads"],
            "peak_pss_mib": round(peak.peak / MiB, 1), "peak_by_process_mib": peak.by_process(),
            "pss_samples": peak.samples, "model": str(out / "model")}


def run_tandem(root: Path, cache: Path, *, preset: str, seed: int, steps: int,
               threads: int | None, interval: float, timeout: float) -> dict[str, Any]:
    import yaml

    from tandem.common.trace import read_trace

    run_dir = root / f"s{seed}-{preset}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a trace appends: start from nothing
    run_dir.mkdir(parents=True)
    config = run_dir.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(tandem_config(run_dir, cache, preset=preset, seed=seed,
                                                   steps=steps, threads=threads),
                                     sort_keys=False))
    code, wall, peak = run_process([TANDEM, "up", str(config), "--plain"], interval=interval,
                                   timeout=timeout, log=run_dir.with_suffix(".log"))
    spans = read_trace(run_dir)
    trains = [s for s in spans if s["kind"] == "train" and s["component"] == "trainer"]
    rollouts = [s for s in spans if s["kind"] == "rollout"]
    if code != 0 or len(trains) != steps:
        raise SystemExit(f"tandem {preset} seed {seed} exited {code} after {len(trains)} of "
                         f"{steps} steps; see {run_dir.with_suffix('.log')}")
    start = min(s["start"] for s in rollouts)
    end = max(s["end"] for s in trains)
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"),
                         key=lambda p: int(p.name.split("_")[1]))
    return {"row": preset, "seed": seed, "steps": len(trains), "phase_s": end - start,
            "s_per_step": (end - start) / len(trains),
            "tokens_per_s": sum(s["attrs"]["tokens"] for s in trains) / (end - start),
            "wall_s": wall, "outside_s": wall - (end - start),
            "busy_train_s": sum(s["end"] - s["start"] for s in trains),
            "busy_rollout_s": sum(s["end"] - s["start"] for s in rollouts),
            "breakdown_s": phase_breakdown(spans),
            "staleness_mean": statistics.fmean(s["step"] - s["version"] for s in rollouts
                                               if s.get("version") is not None),
            "peak_pss_mib": round(peak.peak / MiB, 1), "peak_by_process_mib": peak.by_process(),
            "pss_samples": peak.samples, "model": str(checkpoints[-1]), "run_dir": str(run_dir)}


def evaluate(cache: Path, model: str, seed: int) -> dict[str, float]:
    """Held-out accuracy of a saved model by tandem's own evaluation (`tandem eval`'s code)."""
    import asyncio

    from tandem.explorer.eval_cli import _with_model, model_folder
    from tandem.explorer.eval_cli import evaluate_model
    from tandem.master.quickstart import quickstart_config

    config = quickstart_config(cache / "eval-run", cache / "model-sft",
                               cache / "data" / "train.jsonl", preset="synchronous", steps=1,
                               seed=seed, heldout=cache / "data" / "heldout.jsonl")
    folder, _ = model_folder(Path(model))
    rows = asyncio.run(evaluate_model(_with_model(config, folder), None,
                                      str(cache / "eval.jsonl"), checkpoint=str(folder)))
    metrics = rows[0]["metrics"]
    return {"greedy": metrics["greedy/accuracy"], "sampled": metrics["sampled/accuracy"]}


# -- the report ----------------------------------------------------------------------------------


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: mean and range over seeds; `vs_trl` is TRL's mean s/step over this row's."""
    out = []
    by_row = {r: [x for x in runs if x["row"] == r] for r in ROWS}
    trl = by_row.get("trl")
    for name, mine in by_row.items():
        if not mine:
            continue

        def stat(key: str, rows: list[dict[str, Any]] = mine) -> list[float]:
            values = [r[key] for r in rows]
            return [statistics.fmean(values), min(values), max(values)]

        row = {"row": name, "seeds": [r["seed"] for r in mine], "s_per_step": stat("s_per_step"),
               "tokens_per_s": stat("tokens_per_s"), "peak_pss_mib": stat("peak_pss_mib"),
               "outside_s": stat("outside_s"), "greedy_after": stat("greedy_after"),
               "sampled_after": stat("sampled_after")}
        if trl:
            row["vs_trl"] = stat("s_per_step", trl)[0] / row["s_per_step"][0]
            row["pss_vs_trl"] = row["peak_pss_mib"][0] / stat("peak_pss_mib", trl)[0]
        out.append(row)
    return out


def _mr(v: list[float], fmt: str) -> str:
    return f"{format(v[0], fmt)} ({format(v[1], fmt)}-{format(v[2], fmt)})"


def table(rows: list[dict[str, Any]], before: dict[str, float]) -> str:
    lines = ["| system | s / step | vs TRL | tokens / s | peak PSS MiB (whole tree) | "
             f"PSS vs TRL | held-out greedy after (before {before['greedy']:.2f}) | "
             f"sampled after (before {before['sampled']:.2f}) | outside the phase s |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        name = "TRL `GRPOTrainer`" if r["row"] == "trl" else f"tandem `{r['row']}`"
        vs = f"{r['vs_trl']:.2f}x" if "vs_trl" in r else "-"
        pss_vs = f"{r['pss_vs_trl']:.2f}x" if "pss_vs_trl" in r else "-"
        lines.append(
            f"| {name} | {_mr(r['s_per_step'], '.3f')} | {vs} | "
            f"{_mr(r['tokens_per_s'], '.0f')} | {_mr(r['peak_pss_mib'], '.0f')} | "
            f"{pss_vs} | {_mr(r['greedy_after'], '.2f')} | "
            f"{_mr(r['sampled_after'], '.2f')} | {_mr(r['outside_s'], '.1f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trl-worker"]:
        return trl_worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"),
                        help="the python of a venv with trl and tandem's packages "
                             "(make bench-peer builds .venv-trl)")
    parser.add_argument("--steps", type=int, default=60, help="optimiser steps per run")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the TRL process and of tandem's trainer and "
                             "explorers (default: torch's, every core, for TRL; placement "
                             "auto's for tandem)")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between PSS polls")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--out", default=".bench/bench_peer.json")
    parser.add_argument("--quick", action="store_true", help="smoke check: 4 steps, seed 0")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 4, "0"
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not rows or any(r not in ROWS for r in rows):
        parser.error(f"--rows: choose from {', '.join(ROWS)}")
    if "trl" in rows and not Path(args.trl_python).exists():
        parser.error(f"--trl-python {args.trl_python} does not exist; `make bench-peer` builds "
                     ".venv-trl, or leave trl out of --rows")
    out = Path(args.out)
    root = out.with_suffix("")
    cache = root / "model-cache"
    if not (cache / "model-sft" / "config.json").exists():
        from tandem.master.quickstart import prepare

        prepare(cache, seed=0)
    before = evaluate(cache, str(cache / "model-sft"), 0)
    print(f"starting model (quickstart SFT, seed 0): held-out greedy {before['greedy']:.2f}, "
          f"sampled {before['sampled']:.2f}; {args.steps} steps a run", flush=True)
    # the tree measured is the working tree's: say which, and what in it was not committed
    git = {"commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True, timeout=30).stdout.strip(),
           "modified": subprocess.run(["git", "diff", "--name-only", "HEAD", "--", "packages"],
                                      cwd=REPO, capture_output=True, text=True,
                                      timeout=30).stdout.split()}
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        for name in rows:
            started = time.monotonic()
            kw = dict(seed=seed, steps=args.steps, threads=args.threads,
                      interval=args.interval, timeout=args.run_timeout)
            run = (run_trl(root / "runs", cache, trl_python=args.trl_python, **kw)
                   if name == "trl" else run_tandem(root / "runs", cache, preset=name, **kw))
            after = evaluate(cache, run["model"], seed)
            run.update(greedy_after=after["greedy"], sampled_after=after["sampled"],
                       load=os.getloadavg()[0])
            runs.append(run)
            print(f"seed {seed} {name}: {run['s_per_step']:.3f} s/step, "
                  f"{run['tokens_per_s']:.0f} tok/s, peak PSS {run['peak_pss_mib']:.0f} MiB, "
                  f"greedy {after['greedy']:.2f}, run {time.monotonic() - started:.0f} s, "
                  f"load {run['load']:.1f}", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"args": vars(args), "git": git, "matched": MATCHED,
                                       "unmatched": UNMATCHED, "before": before,
                                       "rows": summarise(runs), "runs": runs}, indent=1))
    print(f"\n{args.steps} optimiser steps a run, seeds {args.seeds}, mean (range)")
    print(table(summarise(runs), before))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
