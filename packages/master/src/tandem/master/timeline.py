"""`tandem timeline RUN_DIR`: draw a run's trace in the sync-pattern figure's visual language.

One lane per explorer, the buffer (its fill level over time) and the trainer; Rollout yellow,
Train green, Sync by NCCL purple, Sync by checkpoint red, Eval blue (an explorer scoring the
`eval` tasksets between its steps), waits hatched grey, on the real time
axis, with each lane's utilisation (busy time / wall-clock) in the legend. A streaming explorer's
groups (`group` events: from its step's start to the group's put) are thin bars stacked inside
the rollout block, ending as each group reaches the buffer. `--html` writes a
self-contained zoomable page (inline SVG, a few lines of script, no network).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from tandem.common.trace import read_trace

from .render import COLOURS, finish_png

BUSY = ("rollout", "train", "sync", "eval")
# placement.colocate: the explorer's engine releasing its weights (sleep), taking memory for them
# again (wake), and the time between, when the trainer has its devices (asleep, drawn here)
ENGINE_STATE = ("sleep", "wake")
STATE_COLOURS = {"sleep": "#2c3e50", "wake": "#16a085", "asleep": "#aab7c4"}
WAIT_COLOUR = "#d0d0d0"
GROUP_COLOUR = "#b8860b"


@dataclass
class Span:
    lane: str
    kind: str
    start: float
    end: float
    step: int | None = None
    version: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def colour(self) -> str:
        if self.kind == "sync":
            return COLOURS["nccl" if self.attrs.get("method") == "nccl" else "checkpoint"]
        return COLOURS.get(self.kind) or STATE_COLOURS.get(self.kind, WAIT_COLOUR)


@dataclass
class RunTimeline:
    """A run's trace as lanes on a time axis starting at 0."""

    explorers: list[str]
    spans: list[Span]
    buffer: list[tuple[float, int]]
    makespan: float
    # sync.max_staleness: auto: (time, bound) from the start, then at every change
    staleness_bounds: list[tuple[float, int]] = field(default_factory=list)

    def lane(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.lane == name]

    def utilization(self) -> dict[str, float]:
        """Busy fraction of the wall-clock per lane (rollout/train/sync/eval count as busy)."""
        out = {}
        for name in self.explorers + ["trainer"]:
            busy = _union([(s.start, s.end) for s in self.lane(name) if s.kind in BUSY])
            out[name] = busy / self.makespan if self.makespan > 0 else 0.0
        return out

    def steady_shares(self) -> dict[str, float] | None:
        """Where the steady state's wall-clock went (issue 27 item 2): from the first train
        step's end (start-up and warm-up left out) to the last's, the shares in which the
        trainer trains, some explorer rolls out, both, neither (barriers, sample/ack, weight
        publish and load between spans), and the busy share of the slower side. Only train and
        rollout spans count as work. None with fewer than two train steps."""
        ends = sorted(s.end for s in self.lane("trainer") if s.kind == "train")
        if len(ends) < 2 or ends[-1] <= ends[0]:
            return None
        lo, hi = ends[0], ends[-1]

        def clipped(kind: str) -> list[tuple[float, float]]:
            return [(max(s.start, lo), min(s.end, hi)) for s in self.spans
                    if s.kind == kind and s.end > lo and s.start < hi]

        window = hi - lo
        train, rollout = clipped("train"), clipped("rollout")
        t, r, either = _union(train), _union(rollout), _union(train + rollout)
        return {"window": window, "train": t / window, "rollout": r / window,
                "both": (t + r - either) / window, "neither": 1 - either / window,
                "slower_busy": max(t, r) / window}

    def groups(self, lane: str) -> list[tuple[Span, int, int]]:
        """A lane's streamed groups: (span, index by time stored within its step, groups in
        the step), for stacking them inside the step's rollout block."""
        by_step: dict[int | None, list[Span]] = {}
        for s in self.lane(lane):
            if s.kind == "group":
                by_step.setdefault(s.step, []).append(s)
        return [(g, i, len(gs)) for gs in by_step.values()
                for i, g in enumerate(sorted(gs, key=lambda g: g.end))]

    def staleness(self) -> dict[int, int]:
        """How many explorer steps ran with weights k versions old (step - version)."""
        counts: dict[int, int] = {}
        for s in self.spans:
            if s.kind == "rollout" and s.step is not None and s.version is not None:
                counts[s.step - s.version] = counts.get(s.step - s.version, 0) + 1
        return dict(sorted(counts.items()))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def load_timeline(run_dir: str | Path) -> RunTimeline:
    """Read `run_dir/trace/*.jsonl` into lanes: explorers, the buffer level, the trainer."""
    raw = read_trace(run_dir)
    lanes_of_interest = [s for s in raw if s["kind"] in BUSY + ENGINE_STATE + ("wait", "group")]
    if not lanes_of_interest:
        raise click.ClickException(f"{run_dir}: the trace has no rollout, train or sync spans")
    t0 = min(s["start"] for s in lanes_of_interest)
    spans: list[Span] = []
    explorers: list[str] = []
    for s in lanes_of_interest:
        component = s["component"]
        lane = "trainer" if component.startswith("trainer") else component
        if lane != "trainer" and lane not in explorers:
            explorers.append(lane)
        spans.append(Span(lane, s["kind"], s["start"] - t0, s["end"] - t0, s.get("step"),
                          s.get("version"), s.get("attrs") or {}))
    explorers.sort()
    makespan = max(s.end for s in spans)
    spans += _asleep(spans, makespan)
    return RunTimeline(explorers, spans, _buffer_levels(raw, spans, t0), makespan,
                       _staleness_bounds(raw, t0))


def _asleep(spans: list[Span], makespan: float) -> list[Span]:
    """Each explorer's asleep intervals: from a sleep's end to the next wake's start."""
    out: list[Span] = []
    for lane in {s.lane for s in spans if s.kind == "sleep"}:
        marks = sorted((s for s in spans if s.lane == lane and s.kind in ENGINE_STATE),
                       key=lambda s: s.start)
        for i, s in enumerate(marks):
            if s.kind != "sleep":
                continue
            wake = next((w for w in marks[i + 1:] if w.kind == "wake"), None)
            out.append(Span(lane, "asleep", s.end, wake.start if wake else makespan, s.step,
                            s.version, {"released_bytes": s.attrs.get("released_bytes")}))
    return out


def _staleness_bounds(raw: list[dict], t0: float) -> list[tuple[float, int]]:
    """The master's `staleness` events as (time, bound), led by the bound the run started
    with (the first change's `previous`) at time 0; empty without `max_staleness: auto`."""
    changes = sorted(((s["start"] - t0, s.get("attrs") or {}) for s in raw
                      if s["kind"] == "staleness"), key=lambda c: c[0])
    if not changes:
        return []
    return [(0.0, int(changes[0][1]["previous"]))] + [(max(0.0, t), int(a["bound"]))
                                                      for t, a in changes]


def _buffer_levels(raw: list[dict], spans: list[Span], t0: float) -> list[tuple[float, int]]:
    """Groups waiting in the buffer: from the buffer's own fill events when it wrote them,
    otherwise derived (+groups when a rollout ends, -groups when a train step starts)."""
    fills = [(s["start"] - t0, int((s.get("attrs") or {}).get("ready", 0)))
             for s in raw if s["kind"] == "buffer_fill"]
    if fills:
        return sorted(fills)
    deltas = []
    streamed = {(s.lane, s.step) for s in spans if s.kind == "group"}
    for s in spans:
        groups = int(s.attrs.get("groups", 1))
        if s.kind == "group":  # a streaming explorer's group, stored as it was scored
            deltas.append((s.end, 1))
        elif s.kind == "rollout" and (s.lane, s.step) not in streamed:
            deltas.append((s.end, groups))
        elif s.kind == "train":
            deltas.append((s.start, -groups))
    level, out = 0, []
    for t, d in sorted(deltas, key=lambda x: (x[0], -x[1])):  # arrivals before departures
        level = max(0, level + d)
        out.append((t, level))
    return out


def render_png(tl: RunTimeline, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bound_lane = ["staleness bound"] if tl.staleness_bounds else []
    lanes = tl.explorers + ["buffer"] + bound_lane + ["trainer"]
    fig, ax = plt.subplots(figsize=(13, 1.2 + 0.6 * len(lanes)))
    y_of = {name: len(lanes) - 1 - i for i, name in enumerate(lanes)}
    for s in tl.spans:
        if s.kind == "group":
            continue
        y = y_of[s.lane]
        height = (0.9 if s.kind in ("sync",) + ENGINE_STATE else
                  0.35 if s.kind == "wait" else 0.2 if s.kind == "asleep" else 0.7)
        ax.broken_barh([(s.start, max(s.end - s.start, tl.makespan / 2000))],
                       (y - height / 2, height), facecolors=s.colour,
                       edgecolors="none" if s.kind in ("wait", "asleep") else "black",
                       linewidth=0.3,
                       hatch="//" if s.kind == "wait" else None)
        if s.kind in ("rollout", "train") and s.step is not None and \
                (s.end - s.start) > tl.makespan / 60:
            ax.text((s.start + s.end) / 2, y, str(s.step), ha="center", va="center", fontsize=7)
        elif s.kind == "eval" and s.version is not None and (s.end - s.start) > tl.makespan / 60:
            ax.text((s.start + s.end) / 2, y, f"v{s.version}", ha="center", va="center",
                    fontsize=7, color="white")
    for lane in tl.explorers:
        for g, i, n in tl.groups(lane):
            h = 0.6 / n
            ax.broken_barh([(g.start, max(g.end - g.start, tl.makespan / 2000))],
                           (y_of[lane] - 0.3 + i * h + h * 0.15, h * 0.7),
                           facecolors=GROUP_COLOUR, edgecolors="none")
    if tl.buffer:
        y = y_of["buffer"]
        times = [0.0] + [t for t, _ in tl.buffer] + [tl.makespan]
        values = [0] + [n for _, n in tl.buffer] + [tl.buffer[-1][1]]
        top = max(1, max(values))
        ax.fill_between(times, y - 0.35, [y - 0.35 + 0.7 * v / top for v in values],
                        step="post", color=COLOURS["buffer"])
        ax.text(tl.makespan * 1.005, y, f"max {top}", fontsize=7, va="center")
    if tl.staleness_bounds:
        y = y_of["staleness bound"]
        times = [t for t, _ in tl.staleness_bounds] + [tl.makespan]
        values = [b for _, b in tl.staleness_bounds]
        top = max(1, max(values))
        ax.step(times, [y - 0.35 + 0.7 * v / top for v in values + values[-1:]], where="post",
                color="black", linewidth=1)
        for t, b in tl.staleness_bounds:
            ax.text(t, y + 0.38, str(b), fontsize=7, va="bottom")
    util = tl.utilization()
    ax.set_yticks([y_of[n] for n in lanes],
                  labels=[f"{n} ({util[n]:.0%})" if n in util else n for n in lanes])
    ax.set_xlim(0, tl.makespan * 1.06)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("seconds since the first span")
    ax.set_title(title or f"run timeline - {tl.makespan:.1f} s wall-clock; "
                 "lane labels give each lane's busy share", fontsize=9)
    asleep = [(label, STATE_COLOURS[kind]) for kind, label in
              (("sleep", "Sleep"), ("asleep", "Asleep (weights released)"), ("wake", "Wake"))
              if any(s.kind == kind for s in tl.spans)]
    return finish_png(fig, ax, path, len(lanes), [("Eval", COLOURS["eval"]),
                                                  *asleep,
                                                  ("Wait", WAIT_COLOUR),
                                                  ("Group streamed", GROUP_COLOUR),
                                                  ("Buffer (groups ready)", COLOURS["buffer"])])


def render_html(tl: RunTimeline, path: str | Path) -> Path:
    """A self-contained page: the same lanes as SVG; wheel zooms the time axis, drag pans."""
    lanes = tl.explorers + ["buffer", "trainer"]
    util = tl.utilization()
    lane_h, left, width = 36, 170, 1200
    scale = width / tl.makespan if tl.makespan > 0 else 1.0
    rects = []
    for s in tl.spans:
        if s.kind == "group":
            continue
        y = lanes.index(s.lane) * lane_h + (4 if s.kind in ("sync",) + ENGINE_STATE else
                                            14 if s.kind == "asleep" else 8)
        h = lane_h - (8 if s.kind in ("sync",) + ENGINE_STATE else
                      28 if s.kind == "asleep" else 16)
        tip = html.escape(f"{s.lane} {s.kind} step={s.step} version={s.version} "
                          f"{s.start:.3f}-{s.end:.3f}s ({s.end - s.start:.3f}s) "
                          f"{json.dumps(s.attrs, default=str)}")
        rects.append(f'<rect class="s" data-x="{s.start * scale:.2f}" '
                     f'data-w="{max((s.end - s.start) * scale, 0.5):.2f}" y="{y}" height="{h}" '
                     f'fill="{s.colour}" stroke="#333" stroke-width="0.3"><title>{tip}</title></rect>')
    for lane in tl.explorers:
        for g, i, n in tl.groups(lane):
            h = (lane_h - 16) / n
            tip = html.escape(f"{lane} group {g.attrs.get('group', '')} step={g.step} "
                              f"version={g.version} stored at {g.end:.3f}s")
            rects.append(f'<rect class="s" data-x="{g.start * scale:.2f}" '
                         f'data-w="{max((g.end - g.start) * scale, 0.5):.2f}" '
                         f'y="{lanes.index(lane) * lane_h + 8 + i * h + h * 0.15:.1f}" '
                         f'height="{h * 0.7:.1f}" fill="{GROUP_COLOUR}"><title>{tip}</title></rect>')
    if tl.buffer:
        top = max(1, max(n for _, n in tl.buffer))
        base = lanes.index("buffer") * lane_h + lane_h - 6
        prev_t, prev_n = 0.0, 0
        for t, n in tl.buffer + [(tl.makespan, tl.buffer[-1][1])]:
            h = (lane_h - 12) * prev_n / top
            rects.append(f'<rect class="s" data-x="{prev_t * scale:.2f}" '
                         f'data-w="{max((t - prev_t) * scale, 0):.2f}" y="{base - h:.1f}" '
                         f'height="{h:.1f}" fill="{COLOURS["buffer"]}"><title>{prev_n} groups '
                         f'ready</title></rect>')
            prev_t, prev_n = t, n
    labels = "".join(
        f'<text x="4" y="{i * lane_h + lane_h / 2 + 4}" font-size="12">{html.escape(n)}'
        f'{f" ({util[n]:.0%})" if n in util else ""}</text>' for i, n in enumerate(lanes))
    height = len(lanes) * lane_h + 30
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tandem timeline</title>
<style>body{{font-family:sans-serif;margin:12px}} svg{{border:1px solid #ccc;cursor:grab}}</style>
</head><body><h3>tandem timeline: {tl.makespan:.1f} s wall-clock</h3>
<p>Wheel: zoom the time axis. Drag: pan. Hover a block for its step, version and timing.</p>
<svg id="tl" width="{left + width + 20}" height="{height}">{labels}
<g id="lanes" transform="translate({left},0)">{''.join(rects)}</g>
<text id="axis" x="{left}" y="{height - 8}" font-size="11"></text></svg>
<script>
const W={width}, M={tl.makespan:.6f}; let k=1, off=0, drag=null;
const rs=[...document.querySelectorAll('rect.s')];
function draw(){{for(const r of rs){{r.setAttribute('x',(+r.dataset.x-off)*k);
r.setAttribute('width',+r.dataset.w*k);}}
document.getElementById('axis').textContent=`${{(off/W*M).toFixed(2)}} s ... ${{((off+W/k)/W*M).toFixed(2)}} s`;}}
const svg=document.getElementById('tl');
svg.addEventListener('wheel',e=>{{e.preventDefault();const x=e.offsetX-{left};const t=off+x/k;
k=Math.max(1,k*(e.deltaY<0?1.25:0.8));off=Math.max(0,t-x/k);draw();}});
svg.addEventListener('mousedown',e=>drag=[e.clientX,off]);
window.addEventListener('mouseup',()=>drag=null);
window.addEventListener('mousemove',e=>{{if(drag){{off=Math.max(0,drag[1]-(e.clientX-drag[0])/k);draw();}}}});
draw();
</script></body></html>"""
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


def summary_rows(tl: RunTimeline) -> list[tuple[str, str]]:
    util = tl.utilization()
    rows = [("wall-clock", f"{tl.makespan:.1f} s")]
    rows += [(f"{name} busy", f"{u:.0%}") for name, u in util.items()]
    steady = tl.steady_shares()
    if steady is not None:
        rows.append(("steady state", f"{steady['window']:.1f} s from the first train step's "
                                     "end to the last"))
        rows.append(("  neither side working", f"{steady['neither']:.1%}"))
        rows.append(("  slower side busy", f"{steady['slower_busy']:.1%}"))
    if tl.staleness_bounds:
        rows.append(("staleness bound (auto)",
                     " -> ".join(str(b) for _, b in tl.staleness_bounds)))
    for lane in tl.explorers:
        asleep = _union([(s.start, s.end) for s in tl.lane(lane) if s.kind == "asleep"])
        if asleep and tl.makespan > 0:
            rows.append((f"{lane} asleep", f"{asleep / tl.makespan:.0%}"))
    stale = tl.staleness()
    if stale:
        rows.append(("staleness (steps: count)", ", ".join(f"{k}: {v}" for k, v in stale.items())))
    return rows


@click.command("timeline")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="PNG to write (default RUN_DIR/timeline.png)")
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None,
              help="also write a zoomable self-contained HTML page here")
def timeline(run_dir: str, output: str | None, html_out: str | None) -> None:
    """Draw RUN_DIR's trace: lanes per explorer, the buffer and the trainer."""
    tl = load_timeline(run_dir)
    png = render_png(tl, output or Path(run_dir) / "timeline.png")
    for name, value in summary_rows(tl):
        click.echo(f"{name:>26}: {value}")
    click.echo(f"{'timeline':>26}: {png}")
    if html_out:
        click.echo(f"{'html':>26}: {render_html(tl, html_out)}")
