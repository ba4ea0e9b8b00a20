"""`tandem up` with real vLLM explorers on CPU (marked `vllm`: `make test-vllm`): the examples
vllm_synchronous.yaml (weights by the trainer's broadcast, over gloo, into vLLM's own workers)
and vllm_fully_async.yaml (weights by checkpoint) run the quickstart task to the end, every step
is trained, the trace's sync spans name the versions vLLM loaded, and the reward rises.

The model is the quickstart's: a tiny Qwen2 warm-started by a short SFT, so that GRPO improves it
within a few dozen steps. Each run is a `tandem up` in a session of its own, started from this
venv (.venv-vllm), so that its explorer imports the same vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from processes import run_group, vllm_processes

from tandem.common.config import load_config
from tandem.common.sync import SyncPlan
from tandem.common.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
# enough steps for the reward to rise past the noise of a 16-prompt batch, and no more
STEPS = 30
WINDOW = 8  # the first and the last steps whose mean rewards are compared

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory) -> tuple[Path, int]:
    """The quickstart's model after its SFT warm start (`tandem quickstart`'s steps 1 and 2);
    returns its folder and its number of parameter tensors (what one weight load carries)."""
    pytest.importorskip("vllm")
    from tandem.master.quickstart import MODEL, reversal_tasks, warm_start
    from tandem.weights.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("vllm-quickstart")
    model, _ = build_tiny_model(root / "model-init", seed=0, **MODEL)
    train, _ = reversal_tasks(0)
    warm_start(root / "model-init", root / "model-sft", train, steps=80, seed=0)
    return root / "model-sft", len(list(model.named_parameters()))


@pytest.mark.parametrize("example", ["vllm_synchronous", "vllm_fully_async"])
def test_tandem_up_with_vllm_explorers_finishes_and_the_reward_rises(quickstart_model, tmp_path,
                                                                     example):
    model_dir, tensors = quickstart_model
    path = ROOT / "examples" / f"{example}.yaml"
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"model.path={model_dir}",
                 f"master.total_steps={STEPS}", "up.timeline=false"]
    config = load_config(path, overrides)
    tandem = Path(sys.executable).parent / "tandem"
    argv = [str(tandem), "up", str(path), "--plain"]
    for item in overrides:
        argv += ["--set", item]
    # the example's taskset path is relative to the repository root
    proc = run_group(argv, timeout=1380, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert vllm_processes() == []

    spans = read_trace(run_dir)
    # every component ended on its own or on its SIGTERM, vLLM's shutdown included: none was
    # SIGKILLed at its stop bound (which would also cut the end of its trace)
    [stop] = [s for s in spans if s["kind"] == "stop" and s["component"] == "up"]
    assert stop["attrs"]["killed"] == [], stop
    plan = SyncPlan.from_config(config.sync, batches_per_step=1)
    trains = [s for s in spans if s["kind"] == "train"]
    assert sorted(s["step"] for s in trains) == list(range(STEPS))
    rollouts = sorted((s for s in spans if s["kind"] == "rollout" and
                       s["component"] == "explorer-0"), key=lambda s: s["step"])
    syncs = [s for s in spans if s["kind"] == "sync" and s["component"] == "explorer-0"]
    loaded = [s["version"] for s in syncs]
    # every load went into vLLM's workers by the preset's method, all of the model's tensors
    assert syncs and all(s["attrs"]["method"] == config.sync.method for s in syncs), syncs
    assert all(s["attrs"]["tensors"] == tensors for s in syncs), syncs
    assert loaded == sorted(set(loaded)), loaded  # never back to an older version
    if plan.asynchronous:
        # each batch was rolled out with a version vLLM had loaded, no staler than the bound
        for span in rollouts:
            assert span["version"] in [0, *loaded], (span, loaded)
            assert span["step"] - span["version"] <= plan.max_staleness, span
        assert loaded[-1] >= STEPS - 1 - plan.max_staleness, loaded
    else:
        # step s rolls out with version s: vLLM loaded each of 1 .. STEPS-1 by broadcast
        assert [s["version"] for s in rollouts] == [plan.version_for_step(s["step"])
                                                    for s in rollouts]
        assert loaded == list(range(1, STEPS)), loaded

    rewards = [s["attrs"]["reward_mean"] for s in rollouts]
    first = sum(rewards[:WINDOW]) / WINDOW
    last = sum(rewards[-WINDOW:]) / WINDOW
    assert last > first, rewards
