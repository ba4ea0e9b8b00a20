"""Each sync preset end to end through real processes (`tandem up`), its trace obeying the plan.

The trace says which weight version each explorer step rolled out with; the SyncPlan of the
preset says which it must be (synchronous presets) or how old it may be (asynchronous ones).
`fully_async` is checked the same way on the run of tests/e2e/test_streaming_steps.py, which
is a fully_async run to its end through `tandem up` anyway. The asynchronous presets also run
with `weights.transport: shared_memory` (the presets it applies to: sync.method checkpoint):
no version reaches the disk, and none is left in /dev/shm after the run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tandem.common.config import RunConfig
from tandem.common.config.placement import resolve_placement
from tandem.common.sync import SyncPlan, preset_explorers
from tandem.common.trace import read_trace
from tandem.master import plan_from
from tandem.master.quickstart import reversal_tasks, write_jsonl
from tandem.master.up import run_up
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
STEPS = 3


def preset_config(tmp_path: Path, model_dir: Path, preset: str,
                  transport: str = "shared_fs") -> RunConfig:
    train, _ = reversal_tasks(0)
    taskset = write_jsonl(train[:64], tmp_path / "train.jsonl")
    explorers = preset_explorers(preset)
    return RunConfig.model_validate({
        "name": preset, "run_dir": str(tmp_path / "run"),
        "model": {"path": str(model_dir)},
        # shared_memory: a staleness bound of 1, so explorers must load new versions (from
        # memory) within these few steps instead of finishing on the initial weights
        "sync": {"preset": preset, "timeout": BACKSTOP,
                 **({"max_staleness": 1} if transport == "shared_memory" else {})},
        "master": {"total_steps": STEPS, "taskset": {"path": str(taskset), "epochs": 10}},
        "explorers": [{"name": f"explorer-{i}", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}} for i in range(explorers)],
        "trainer": {"groups_per_step": 2 * explorers, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": BACKSTOP},
        "weights": {"transport": transport},
        "logging": {"level": "warning"},
        "up": {"run_timeout": BACKSTOP},
    })


@pytest.mark.parametrize("preset,transport", [
    ("synchronous", "shared_fs"), ("one_step_off_policy", "shared_fs"),
    ("multi_explorer_async", "shared_memory"), ("fully_async", "shared_memory")])
def test_preset_runs_and_its_trace_obeys_the_plan(tmp_path, tiny_model_dir, preset, transport):
    config = preset_config(tmp_path, tiny_model_dir, preset, transport)
    assert run_up(config, live=False) == 0
    if transport == "shared_memory":
        from tandem.weights import list_versions
        from tandem.weights.shm import list_segments

        assert list_versions(config.run_dir) == []  # every version went through memory
        assert list_segments(config.run_dir) == []  # and none outlived the trainer
        loads = [s for s in read_trace(config.run_dir)
                 if s["kind"] == "sync" and s["component"].startswith("explorer")]
        assert loads, "no explorer loaded a version"
    spans = read_trace(config.run_dir)
    plan = SyncPlan.from_config(config.sync, batches_per_step=len(config.explorers))
    rollouts = [s for s in spans if s["kind"] == "rollout"]
    trains = [s for s in spans if s["kind"] == "train"]
    assert sorted(s["step"] for s in trains) == list(range(STEPS))
    assert rollouts, "no rollout spans"
    for span in rollouts:
        step, version = span["step"], span["version"]
        if plan.asynchronous:
            assert step - version <= plan.max_staleness, span
        else:
            assert version == plan.version_for_step(step), span
    syncs = Counter((s["component"], (s.get("attrs") or {}).get("method")) for s in spans
                    if s["kind"] == "sync")
    method = config.sync.method
    assert syncs[("trainer", method)] >= 1, syncs
    if not plan.asynchronous:
        # every sync point the explorer reached loaded its weights by the preset's method
        reached = {s["step"] for s in rollouts if plan.is_sync_point(s["step"])}
        assert syncs[("explorer-0", method)] >= len(reached), syncs
    assert (Path(config.run_dir) / "timeline.png").exists()
    # tandem plan --from on this run: its own knobs replayed over its trace, with the gaps and
    # the sharing of cores it measured (docs/sync.md)
    d = plan_from.measure(config.run_dir)
    table = resolve_placement(config)
    assert d.sharing.threads == {lane: table[lane].threads for lane in d.sharing.threads}
    assert min(d.gaps.sample, d.gaps.publish, d.gaps.load, d.gaps.rollout) >= 0
    own = plan_from.predict(d, "own", plan)
    assert own.staleness()[1] <= plan.max_staleness and own.steady_step_time > 0
    # the trainer and every explorer said Goodbye: the master did not serve out its stop_grace
    assert "master.goodbye_missing" not in (Path(config.run_dir) / "logs" / "master.out").read_text()
