"""`tandem timeline` from a hand-written trace: lanes, utilisation, staleness, PNG and HTML."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tandem.common.trace import Tracer
from tandem.master.cli import tandem
from tandem.master.timeline import load_timeline


def write_trace(run_dir):
    e0, e1, tr = (Tracer(run_dir, n) for n in ("explorer-0", "explorer-1", "trainer"))
    t = 1000.0
    e0.record("rollout", t + 0, t + 2, step=0, version=0, groups=2)
    e0.record("sync", t + 4, t + 4.5, step=1, version=1, method="checkpoint")
    e0.record("rollout", t + 4.5, t + 6.5, step=1, version=1, groups=2)
    e1.record("rollout", t + 0, t + 3, step=0, version=0, groups=2)
    e1.record("wait", t + 3, t + 5, step=1)
    e1.record("rollout", t + 5, t + 8, step=2, version=0, groups=2)
    tr.record("train", t + 2, t + 4, step=0, version=1, groups=2)
    tr.record("sync", t + 4, t + 4.2, version=1, method="checkpoint")
    tr.record("train", t + 6.5, t + 8, step=1, version=2, groups=2)
    for tracer in (e0, e1, tr):
        tracer.close()


def test_lanes_utilisation_and_staleness(tmp_path):
    write_trace(tmp_path)
    tl = load_timeline(tmp_path)
    assert tl.explorers == ["explorer-0", "explorer-1"] and tl.makespan == 8.0
    util = tl.utilization()
    assert util["explorer-0"] == pytest.approx((2 + 0.5 + 2) / 8)
    assert util["explorer-1"] == pytest.approx(6 / 8)  # the wait does not count as busy
    assert util["trainer"] == pytest.approx((2 + 0.2 + 1.5) / 8)
    assert tl.staleness() == {0: 3, 2: 1}
    # +2 groups when a rollout ends, -2 when a train step starts
    assert tl.buffer == [(2.0, 2), (2.0, 0), (3.0, 2), (6.5, 4), (6.5, 2), (8.0, 4)]


def test_cli_writes_png_and_html(tmp_path):
    write_trace(tmp_path)
    out = tmp_path / "tl.png"
    result = CliRunner().invoke(tandem, ["timeline", str(tmp_path), "-o", str(out), "--html",
                                         str(tmp_path / "tl.html")])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "tl.html").read_text()
    assert page.count('class="s"') >= 9 and "explorer-1 (75%)" in page
    assert "trainer busy" in result.output


def test_empty_trace_is_a_clear_error(tmp_path):
    (tmp_path / "trace").mkdir()
    result = CliRunner().invoke(tandem, ["timeline", str(tmp_path)])
    assert result.exit_code != 0 and "no rollout, train or sync spans" in result.output


def test_an_eval_span_is_a_busy_block_in_its_explorers_lane(tmp_path):
    write_trace(tmp_path)
    e0 = Tracer(tmp_path, "explorer-0")
    e0.record("eval", 1000.0 + 2, 1000.0 + 3, step=1, version=1, tasks=100)
    e0.close()
    tl = load_timeline(tmp_path)
    (block,) = [s for s in tl.lane("explorer-0") if s.kind == "eval"]
    assert (block.start, block.end, block.version) == (2.0, 3.0, 1)
    assert block.colour == "#4a90d9"
    assert tl.utilization()["explorer-0"] == pytest.approx((2 + 1 + 0.5 + 2) / 8)
    assert tl.staleness() == {0: 3, 2: 1}  # an evaluation is no rollout
    out = tmp_path / "tl.png"
    result = CliRunner().invoke(tandem, ["timeline", str(tmp_path), "-o", str(out)])
    assert result.exit_code == 0 and out.read_bytes()[:4] == b"\x89PNG"


def test_streamed_groups_stack_inside_their_rollout_and_fill_the_buffer_one_by_one(tmp_path):
    e0, tr = Tracer(tmp_path, "explorer-0"), Tracer(tmp_path, "trainer")
    t = 1000.0
    e0.record("rollout", t + 0, t + 4, step=0, version=0, groups=3)
    for end, name in ((t + 1, "a"), (t + 2.5, "b"), (t + 4, "c")):  # stored as each is scored
        e0.record("group", t + 0, end, step=0, version=0, group=name, experiences=2)
    tr.record("train", t + 4, t + 5, step=0, version=1, groups=3)
    e0.close()
    tr.close()
    tl = load_timeline(tmp_path)
    stacked = [(g.attrs["group"], i, n) for g, i, n in tl.groups("explorer-0")]
    assert stacked == [("a", 0, 3), ("b", 1, 3), ("c", 2, 3)]
    assert tl.utilization()["explorer-0"] == pytest.approx(4 / 5)  # groups are not extra time
    # the derived buffer line rises group by group, not all at the rollout's end
    assert tl.buffer == [(1.0, 1), (2.5, 2), (4.0, 3), (4.0, 0)]
    out = tmp_path / "tl.png"
    result = CliRunner().invoke(tandem, ["timeline", str(tmp_path), "-o", str(out), "--html",
                                         str(tmp_path / "tl.html")])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "tl.html").read_text()
    assert page.count("explorer-0 group ") == 3 and "stored at 2.500s" in page


def test_steady_shares_from_the_first_train_end_to_the_last(tmp_path):
    write_trace(tmp_path)
    tl = load_timeline(tmp_path)
    shares = tl.steady_shares()
    # window 4 .. 8: rollouts cover 4.5-8 (3.5 s), train 6.5-8 (1.5 s, inside them);
    # neither: 4-4.5 (the checkpoint load, the wait)
    assert shares["window"] == pytest.approx(4.0)
    assert shares["neither"] == pytest.approx(0.5 / 4)
    assert shares["both"] == pytest.approx(1.5 / 4)
    assert shares["slower_busy"] == pytest.approx(3.5 / 4)
    result = CliRunner().invoke(tandem, ["timeline", str(tmp_path), "-o",
                                         str(tmp_path / "tl.png")])
    assert "neither side working: 12.5%" in result.output
