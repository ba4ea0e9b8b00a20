"""tools/plan_accuracy.py on hand-written traces laid out as bench_sync's run dirs: the rows it
compares, its own-trace mode, and the plan code of a git revision loaded beside the tree's."""

from __future__ import annotations

import plan_accuracy
from plan_traces import write_shared_run, write_sync_run


def test_rows_own_mode_and_an_old_revision(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_sync_run(runs / "r0-x1-synchronous")
    write_shared_run(runs / "r0-x1-fully_async", stretch=1.0)
    assert plan_accuracy.main(["--runs", str(runs), "--own"]) == 0
    out = capsys.readouterr().out
    # each run replayed over its own trace: the synchronous one exactly
    assert "| 0 | 1 | synchronous | 3.100 | 3.100 | +0% |" in out
    assert "each run from its own trace: within 10% in 2 of 2 runs" in out
    assert plan_accuracy.main(["--runs", str(runs)]) == 0
    assert "plan code working tree: within 10% in" in capsys.readouterr().out
    # the plan code of a git revision, loaded beside the tree's, on the same traces
    assert plan_accuracy.main(["--runs", str(runs), "--rev", "HEAD"]) == 0
    assert "plan code HEAD: within 10% in" in capsys.readouterr().out
