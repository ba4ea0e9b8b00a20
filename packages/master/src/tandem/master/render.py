"""Draw a simulated timeline in the sync-pattern figure's visual language: on a terminal with rich,
or as a PNG with matplotlib. Rollout yellow, train green, NCCL sync purple, checkpoint sync red,
the buffer light blue."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .simulate import Block, Timeline

COLOURS = {"rollout": "#f2c230", "train": "#5cb85c", "nccl": "#8e44ad", "checkpoint": "#d9534f",
           "buffer": "#a6d8f0", "eval": "#4a90d9"}
_TERM = {"rollout": ("▆", "black on yellow"), "train": ("▆", "black on green"),
         "nccl": ("S", "bold white on purple"), "checkpoint": ("C", "bold white on red")}


def _style_key(block: Block) -> str:
    return block.method if block.kind == "sync" else block.kind


def _lane_text(blocks: list[Block], width: int, scale: float) -> Text:
    cells: list[tuple[str, str]] = [(" ", "")] * width
    owner: list[int] = [-1] * width
    # rollouts and trains first, syncs over them so a short sync stays visible
    ordered = sorted(blocks, key=lambda b: b.kind == "sync")
    spans = []
    for i, block in enumerate(ordered):
        char, style = _TERM[_style_key(block)]
        lo = min(width - 1, round(block.start / scale))
        hi = max(lo + 1, min(width, round(block.end / scale)))
        spans.append((lo, hi))
        for col in range(lo, hi):
            cells[col], owner[col] = (char, style), i
    # the step number goes where the block is still visible, if it fits
    for i, block in enumerate(ordered):
        if block.kind == "sync" or block.step is None:
            continue
        label = str(block.step)
        visible = [c for c in range(*spans[i]) if owner[c] == i]
        if len(visible) > len(label):
            for k, ch in enumerate(label):
                cells[visible[k]] = (ch, cells[visible[k]][1])
    out = Text()
    for text, style in cells:
        out.append(text, style=style)
    return out


def _buffer_text(timeline: Timeline, width: int, scale: float) -> Text:
    out = Text()
    levels = timeline.buffer
    for col in range(width):
        t = (col + 0.5) * scale
        level = 0
        for at, n in levels:
            if at > t:
                break
            level = n
        out.append("·" if level == 0 else (str(level) if level < 10 else "+"),
                   style="black on bright_cyan" if level else "cyan")
    return out


def render_terminal(timeline: Timeline, console: Console | None = None, width: int = 96) -> None:
    """Lanes per explorer, the buffer and the trainer, then makespan, utilisation, speedup."""
    width = max(20, width)
    console = console or Console(soft_wrap=True)
    scale = timeline.makespan / width if timeline.makespan > 0 else 1.0
    plan = timeline.plan
    console.print(
        f"plan: method={plan.method} interval={plan.interval} "
        f"offset={'null' if plan.offset is None else plan.offset} "
        f"max_staleness={plan.max_staleness}  ({timeline.explorers} explorer(s), "
        f"one column = {scale:.3g} s)")
    names = [f"explorer-{i}" for i in range(timeline.explorers)]
    pad = max(len(n) for n in names + ["trainer"]) + 1
    for name in names:
        console.print(Text(name.ljust(pad)) + _lane_text(timeline.lane(name), width, scale))
    console.print(Text("buffer".ljust(pad)) + _buffer_text(timeline, width, scale))
    console.print(Text("trainer".ljust(pad)) + _lane_text(timeline.lane("trainer"), width, scale))
    axis = "0 s".ljust(width - 8) + f"{timeline.makespan:>8.3g}"
    console.print(" " * pad + axis)
    legend = Text(" " * pad)
    for name, key in (("rollout", "rollout"), ("train", "train"), ("sync (NCCL)", "nccl"),
                      ("sync (checkpoint)", "checkpoint")):
        char, style = _TERM[key]
        legend.append(char * 2, style=style)
        legend.append(f" {name}   ")
    legend.append("digits: batches waiting in the buffer")
    console.print(legend)

    util = timeline.utilization()
    table = Table(show_header=True, header_style="bold")
    table.add_column("makespan (s)", justify="right")
    table.add_column("trainer busy", justify="right")
    for name in names:
        table.add_column(f"{name} busy", justify="right")
    table.add_column("speedup vs synchronous", justify="right")
    speedup = timeline.speedup_vs_synchronous
    table.add_row(f"{timeline.makespan:.3f}", f"{util['trainer']:.0%}",
                  *[f"{u:.0%}" for u in util["explorers"]],
                  "-" if speedup is None else f"{speedup:.2f}x")
    console.print(table)


def render_png(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Save the timeline as a PNG (matplotlib, imported only when asked for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"explorer-{i}" for i in range(timeline.explorers)]
    lanes = names + ["buffer", "trainer"]
    fig_h = 1.0 + 0.55 * len(lanes)
    fig, ax = plt.subplots(figsize=(12, fig_h))
    y_of = {name: len(lanes) - 1 - i for i, name in enumerate(lanes)}
    for block in timeline.blocks:
        y = y_of[block.lane]
        colour = COLOURS[_style_key(block)]
        height = 0.7 if block.kind != "sync" else 0.9
        ax.broken_barh([(block.start, block.end - block.start)], (y - height / 2, height),
                       facecolors=colour, edgecolors="black", linewidth=0.4)
        if block.kind != "sync" and block.step is not None:
            ax.text((block.start + block.end) / 2, y, str(block.step), ha="center",
                    va="center", fontsize=7)
    levels = timeline.buffer
    if levels:
        times = [0.0] + [t for t, _ in levels] + [timeline.makespan]
        values = [0] + [n for _, n in levels] + [levels[-1][1]]
        top = max(1, max(values))
        y = y_of["buffer"]
        scaled = [y - 0.35 + 0.7 * v / top for v in values]
        ax.fill_between(times, y - 0.35, scaled, step="post", color=COLOURS["buffer"])
        ax.axhline(y - 0.35, color=COLOURS["buffer"], linewidth=0.5)
    ax.set_yticks([y_of[n] for n in lanes], labels=lanes)
    ax.set_xlim(0, timeline.makespan * 1.01)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("seconds")
    util = timeline.utilization()
    speedup = timeline.speedup_vs_synchronous
    plan = timeline.plan
    ax.set_title(title or (
        f"{plan.method}, interval {plan.interval}, offset "
        f"{'null' if plan.offset is None else plan.offset}, max_staleness {plan.max_staleness}"
        f" - makespan {timeline.makespan:.2f} s, trainer busy {util['trainer']:.0%}"
        + ("" if speedup is None else f", {speedup:.2f}x vs synchronous")), fontsize=9)
    return finish_png(fig, ax, path, len(lanes), [("Buffer", COLOURS["buffer"])])


def finish_png(fig, ax, path: str | Path, lanes: int, extra: list[tuple[str, str]]) -> Path:
    """The figure's legend (Rollout, Train, both syncs, then `extra` (label, colour)), grid, save."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    entries = [("Rollout", COLOURS["rollout"]), ("Train", COLOURS["train"]),
               ("Sync. weight (NCCL)", COLOURS["nccl"]),
               ("Sync. weight (Checkpoint)", COLOURS["checkpoint"]), *extra]
    ax.legend(handles=[Patch(color=colour, label=label) for label, colour in entries],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if lanes < 5 else -0.2),
              ncol=min(len(entries), 6), fontsize=8, frameon=False)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
