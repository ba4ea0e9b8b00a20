"""A live run survives hostile frames at every RPC socket: no crash, no lasting memory, and
the run trains on afterwards and stops cleanly (the short version of tools/fuzz_wire.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fuzz_wire
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
GROWTH_KIB = 40 * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_fuzzed_sockets_cost_no_crash_no_memory_and_the_run_finishes(tmp_path, tiny_model_dir):
    # a run far longer than the fuzzing, stopped by SIGTERM once it trained on after it
    # memory is read once it is back under the bound (the trim runs in each component's own
    # loop a second after its last refusal), not after a fixed sleep a busy machine outlasts
    report = fuzz_wire.fuzz_run(tmp_path, tiny_model_dir, frames=1000, steps=100_000, seed=1,
                                then="stop", run_timeout=BACKSTOP, rss_growth_kib=GROWTH_KIB)
    assert report["crashes"] == 0, report["targets"]
    for name, target in report["targets"].items():
        assert sum(target["sent"].values()) == 1000
        assert target["replies"].get("internal", 0) == 0
        errors = sum(n for code, n in target["replies"].items() if code != "ok")
        assert errors > 100, f"{name} answered only {errors} hostile requests with an error"
        growth = target["rss_after_kib"] - target["rss_before_kib"]
        assert growth < GROWTH_KIB, f"{name} grew by {growth / 1024:.0f} MB"
    assert report["finished"], report["up_tail"]
    assert not report["run_ended_before_fuzzing"]
    assert fuzz_wire.component_pids(tmp_path / "run") == {}
