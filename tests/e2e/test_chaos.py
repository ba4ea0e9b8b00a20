"""tools/chaos.py in make test: a fully_async run whose explorer dies right after the buffer
acked its put (before it told the master) and whose trainer dies in the middle of a step still
finishes with every count at zero: nothing acked is lost, no task is rolled out or trained
twice, and the learner holds exactly the steps the master counted. The same with
`weights.transport: shared_memory`: the killed trainer's segments go with it (its resource
tracker unlinks them), the restarted one publishes its version again, and none is left after."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import chaos
from backstop import BACKSTOP

STEPS = 16


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shared_fs", "shared_memory"])
def test_kills_after_a_put_and_mid_step_lose_nothing_and_train_nothing_twice(
        tmp_path, tiny_model_dir, transport):
    strikes = chaos.parse_strikes("explorer:after-put,trainer:mid-train")
    report = chaos.run_one(tmp_path, tiny_model_dir, "fully_async", strikes, steps=STEPS,
                           seed=0, run_timeout=BACKSTOP, moment_timeout=BACKSTOP,
                           sync_timeout=BACKSTOP, transport=transport, log=lambda _: None)
    assert [s["status"] for s in report["strikes"]] == ["done", "done"], [
        (s["label"], s["status"], s["evidence"]) for s in report["strikes"]]
    assert report["restarts"].get("explorer-0", 0) >= 1 and report["restarts"].get("trainer", 0) >= 1
    summary = {k: report.get(k) for k in (*chaos.ZERO, "result", "db_integrity", "master_steps",
                                          "learner_steps", "examples")}
    assert report["result"] == "finished", (summary, report.get("output_tail"))
    assert report["db_integrity"] == "ok"
    assert report["experiences_acked"] == report["experiences_stored"] > 0
    assert {k: report[k] for k in chaos.ZERO} == dict.fromkeys(chaos.ZERO, 0), summary
    assert report["master_steps"] == report["learner_steps"] == STEPS, summary
    assert report["clean"]


def test_strike_specs_are_checked_and_every_component_gets_its_kills():
    assert [s.label for s in chaos.parse_strikes("reward:mid-score:pause=2.5, buffer:after-put")] \
        == ["reward:mid-score:pause=2.5", "buffer:after-put:kill"]
    for bad, says in (("trainer", "component:moment"), ("gpu:mid-train", "component must be"),
                      ("trainer:later", "moment must be"), ("trainer:mid-train:stop=3", "pause=")):
        with pytest.raises(SystemExit, match=says):
            chaos.parse_strikes(bad)
    planned = chaos.planned_strikes(3, seed=1)
    assert sorted(s.component for s in planned) == sorted(chaos.COMPONENTS * 3)
    assert all(s.moment in chaos.MOMENTS_FOR[s.component] and s.pause is None for s in planned)
    mixed = chaos.planned_strikes(1, seed=1, pauses=1, pause_seconds=12)
    assert sorted(s.label for s in mixed if s.pause is None) == sorted(
        f"{c}:{chaos.MOMENTS_FOR[c][0]}:kill" for c in chaos.COMPONENTS)
    assert sorted(s.label for s in mixed if s.pause is not None) == sorted(
        f"{c}:{chaos.MOMENTS_FOR[c][1]}:pause=12" for c in chaos.COMPONENTS)


def test_the_stall_scenario_pauses_trainer_buffer_and_master_past_both_bounds(tmp_path):
    strikes = chaos.parse_strikes(chaos.STALLS.format(s=50))
    assert [s.label for s in strikes] == ["trainer:mid-train:pause=50",
                                          "buffer:mid-train:pause=50",
                                          "master:mid-rollout:pause=50"]
    assert min(s.pause for s in strikes) > max(chaos.STALL_KNOBS.values())
    path = chaos.write_config(tmp_path, tmp_path / "model", preset="fully_async", steps=40,
                              seed=0, restarts=5, batch_size=2, repeat=2, run_timeout=900,
                              **chaos.STALL_KNOBS)
    config = chaos.yaml.safe_load(path.read_text())
    assert config["sync"]["timeout"] == 30 and config["transport"]["liveness"] == 10
    # acked = trained and dispatched = consumed are counts that must be zero
    assert {"experiences_acked_not_trained", "tasks_dispatched_not_consumed"} <= set(chaos.ZERO)
