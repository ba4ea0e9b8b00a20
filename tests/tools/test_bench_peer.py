"""tools/bench_peer.py's two configs: the tandem run and TRL's GRPOConfig carry every matched
setting (TRL's side is built and checked only where trl is installed, e.g. `.venv-trl`), and
the summary sets each row against TRL's mean."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench_peer
from bench_peer import MATCHED
from tandem.common.config import RunConfig


@pytest.mark.parametrize("preset", bench_peer.PRESETS)
def test_tandem_config_carries_the_matched_settings(tmp_path: Path, preset: str):
    config = RunConfig.model_validate(bench_peer.tandem_config(
        tmp_path / "run", tmp_path / "cache", preset=preset, seed=2, steps=7))
    t = config.trainer
    assert sum(e.batch_size for e in config.explorers) == MATCHED["prompts_per_step"]
    assert t.groups_per_step == MATCHED["prompts_per_step"]
    for e in config.explorers:
        assert e.repeat_times == MATCHED["group_size"]
        s = e.sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (
            MATCHED["temperature"], MATCHED["top_p"], MATCHED["top_k"], MATCHED["max_new_tokens"])
    assert (t.lr, tuple(t.betas), t.adam_eps, t.weight_decay, t.max_grad_norm) == (
        MATCHED["lr"], MATCHED["betas"], MATCHED["adam_eps"], MATCHED["weight_decay"],
        MATCHED["max_grad_norm"])
    assert (t.schedule, t.warmup_steps, t.precision, t.gradient_checkpointing) == (
        "constant", 0, "fp32", False)
    assert (t.clip_low, t.clip_high, t.kl.coef, t.std_eps, t.entropy_coef) == (
        MATCHED["clip"], MATCHED["clip"], MATCHED["kl_coef"], MATCHED["std_eps"],
        MATCHED["entropy_coef"])
    assert (t.advantage, t.loss.name, t.aggregation, t.ppo_epochs, t.mini_batches) == (
        "grpo", "ppo_clip", "token_mean", 1, 1)
    assert config.master.total_steps == 7 and config.seed == 2
    assert config.sync.preset == preset
    assert not config.eval.tasksets  # evaluated after the run, the same way as TRL's model


def test_trl_settings_override_trls_defaults_with_tandems():
    s = bench_peer.trl_settings(Path("out"), seed=1, steps=9)
    assert (s["bf16"], s["gradient_checkpointing"], s["optim"], s["lr_scheduler_type"]) == (
        False, False, "adamw_torch", "constant")
    assert s["per_device_train_batch_size"] == MATCHED["prompts_per_step"] * MATCHED["group_size"]
    assert (s["num_generations"], s["max_completion_length"], s["learning_rate"]) == (
        MATCHED["group_size"], MATCHED["max_new_tokens"], MATCHED["lr"])
    assert (s["epsilon"], s["epsilon_high"], s["beta"], s["max_grad_norm"]) == (
        MATCHED["clip"], MATCHED["clip"], MATCHED["kl_coef"], MATCHED["max_grad_norm"])
    assert (s["max_steps"], s["seed"], s["num_iterations"], s["loss_type"]) == (9, 1, 1, "dapo")


def test_trl_accepts_the_settings_and_steps_once_per_generation(tmp_path: Path):
    trl = pytest.importorskip("trl", reason="TRL lives in .venv-trl (make bench-peer)")
    config = trl.GRPOConfig(**bench_peer.trl_settings(tmp_path, seed=0, steps=3))
    assert config.generation_batch_size == MATCHED["prompts_per_step"] * MATCHED["group_size"]
    assert config.steps_per_generation == 1 and not config.bf16


def run(row: str, seed: int, s_per_step: float, pss: float) -> dict:
    return {"row": row, "seed": seed, "s_per_step": s_per_step, "tokens_per_s": 100.0,
            "peak_pss_mib": pss, "outside_s": 1.0, "greedy_after": 0.5, "sampled_after": 0.4}


def test_summary_is_mean_and_range_against_trls_mean():
    rows = {r["row"]: r for r in bench_peer.summarise([
        run("trl", 0, 0.2, 500), run("trl", 1, 0.4, 700),
        run("synchronous", 0, 0.5, 900), run("synchronous", 1, 0.7, 1100)])}
    assert rows["trl"]["s_per_step"] == pytest.approx([0.3, 0.2, 0.4])
    assert rows["synchronous"]["vs_trl"] == pytest.approx(0.3 / 0.6)
    assert rows["synchronous"]["pss_vs_trl"] == pytest.approx(1000 / 600)


def span(component: str, kind: str, start: float, end: float) -> dict:
    return {"component": component, "kind": kind, "start": start, "end": end}


def test_phase_breakdown_splits_the_phase_between_the_sides():
    spans = [span("explorer-0", "rollout", 0, 2), span("trainer", "sync", 2, 2.5),
             span("explorer-0", "sync", 2.5, 3), span("trainer", "train", 3, 5),
             span("explorer-0", "rollout", 4, 6), span("trainer", "train", 6.5, 8),
             span("trainer", "wait", 5, 6.5)]
    b = bench_peer.phase_breakdown(spans)
    assert b == pytest.approx({"phase": 8, "train": 3.5, "rollout": 4, "both": 1,
                               "neither": 1.5, "publish": 0.5, "load": 0.5})
