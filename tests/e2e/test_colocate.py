"""`placement.colocate` through real processes (`tandem up`, issue 29 item 2): the explorer
shares the trainer's devices, sleeps (weights released) once each step is stored and wakes to
the next version from shared memory. The run trains exactly what the same run with separate
copies trains (same seed: the same loss and token count at every step, to 1e-6), so time-sharing
changes where the weights live, never what is learned; its trace shows every sleep before the
trainer's step and every wake before the next load, and the timeline draws them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from processes import run_group

from tandem.common.config import RunConfig
from tandem.common.trace import read_trace
from tandem.master.quickstart import reversal_tasks, write_jsonl
from tandem.master.timeline import load_timeline
from tandem.master.up import run_up
from backstop import BACKSTOP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1560)]
STEPS = 4


def config(tmp_path: Path, model_dir: Path, colocate: bool) -> RunConfig:
    train, _ = reversal_tasks(0)
    taskset = write_jsonl(train[:64], tmp_path / "train.jsonl")
    name = "colocated" if colocate else "separate"
    return RunConfig.model_validate({
        "name": name, "run_dir": str(tmp_path / name), "seed": 0,
        "model": {"path": str(model_dir)},
        "sync": {"preset": "synchronous", "method": "checkpoint", "timeout": BACKSTOP},
        "weights": {"transport": "shared_memory"},
        "placement": {"colocate": ["trainer", "explorer-0"] if colocate else []},
        "master": {"total_steps": STEPS, "taskset": {"path": str(taskset), "seed": 0,
                                                     "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 4,
                       "workflow_args": {"reward_fn": "format", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-3},
        # a lowercase letter among the tiny random model's 3 characters (p ~ 0.6) gives every
        # step a learning signal, so the weights move and each wake loads different ones
        "reward": {"functions": {"format": 1.0}, "args": {"format": {"pattern": ".*[a-z].*"}}},
        "transport": {"liveness": BACKSTOP},
        "logging": {"level": "warning"},
        "up": {"run_timeout": BACKSTOP},
    })


def trained(run_dir: str) -> list[tuple[int, float, int]]:
    """(step, loss/total, batch/tokens) of each step, from TensorBoard (unrounded)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    events.Reload()
    tokens = {e.step: int(e.value) for e in events.Scalars("batch/tokens")}
    return [(e.step - 1, e.value, tokens[e.step]) for e in events.Scalars("loss/total")]


def test_colocated_run_sleeps_wakes_and_trains_what_separate_copies_train(tmp_path,
                                                                          tiny_model_dir):
    from tandem.weights.shm import list_segments

    runs = {}
    for colocate in (True, False):
        c = config(tmp_path, tiny_model_dir, colocate)
        assert run_up(c, live=False) == 0, c.name
        assert list_segments(c.run_dir) == []  # no version outlived the run
        runs[colocate] = c
    colocated, separate = trained(runs[True].run_dir), trained(runs[False].run_dir)
    assert [s for s, _, _ in colocated] == list(range(STEPS))
    assert len({loss for _, loss, _ in colocated}) > 1  # the weights moved
    for (s1, l1, t1), (s2, l2, t2) in zip(colocated, separate, strict=True):
        assert (s1, t1) == (s2, t2) and l1 == pytest.approx(l2, abs=1e-6), (colocated, separate)

    spans = read_trace(runs[True].run_dir)
    mine = sorted((s for s in spans if s["component"] == "explorer-0"), key=lambda s: s["start"])
    of = lambda kind: {s["step"]: s for s in mine if s["kind"] == kind}
    sleeps, wakes, loads, rollouts = of("sleep"), of("wake"), of("sync"), of("rollout")
    trains = {s["step"]: s for s in spans if s["kind"] == "train"}
    # asleep after every step (no final evaluation here: tests/master/test_clock.py has the
    # explorer that evaluates at the end stay awake after its last step)
    assert sorted(sleeps) == list(range(STEPS)), mine
    assert sorted(wakes) == list(range(1, STEPS)), mine
    for step, sleep in sleeps.items():
        assert sleep["attrs"]["released_bytes"] > 0
        assert rollouts[step]["end"] <= sleep["start"]
        # the report that releases the trainer follows the sleep
        assert sleep["end"] <= trains[step]["start"], (sleep, trains[step])
        if step + 1 == STEPS:
            continue
        wake = wakes[step + 1]
        assert trains[step]["end"] <= wake["start"] and wake["end"] <= loads[step + 1]["start"]
        assert loads[step + 1]["version"] == step + 1
    assert not any(s["kind"] in ("sleep", "wake") for s in read_trace(runs[False].run_dir))

    tl = load_timeline(runs[True].run_dir)
    assert len([s for s in tl.spans if s.kind == "asleep"]) == STEPS
    assert (Path(runs[True].run_dir) / "timeline.png").exists()


def test_colocated_quickstart_sleeps_between_steps_and_evaluates_at_both_ends(tmp_path):
    """`tandem quickstart --colocate`, short: the explorer asleep through every trainer step
    but the last (it evaluates at the end), held-out evaluation before the first step and
    after the last. That a colocated run learns is not run again here: the test above shows
    it trains exactly what separate copies train, and tests/e2e/test_quickstart.py that the
    quickstart's separate copies raise held-out accuracy (a 50-step colocated quickstart was
    the suite's longest test, 94 s of CPU)."""
    steps = 6
    run_dir = tmp_path / "qs"
    tandem = Path(sys.executable).parent / "tandem"
    proc = run_group([str(tandem), "quickstart", "--colocate", "--plain", "--run-dir",
                      str(run_dir), "--steps", str(steps), "--sft-steps", "10"],
                     timeout=1500, stall=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["colocate"] and result["versions"] == [0, steps - 1], result
    assert "held-out accuracy" in proc.stdout
    spans = read_trace(run_dir / "grpo")
    kinds = [s["kind"] for s in spans if s["component"] == "explorer-0"]
    assert kinds.count("sleep") == kinds.count("wake") == steps - 1, kinds
    trained = sorted(s["step"] for s in spans if s["kind"] == "train")
    assert trained == list(range(steps)), trained
    assert (run_dir / "grpo" / "timeline.png").exists()
