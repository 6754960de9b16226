from __future__ import annotations

from collections.abc import Sequence as SequenceLike

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .engine.step_trace import StepRecord

PREFILL_COLOR, DECODE_COLOR, RECOMPUTE_COLOR = "#f6a04d", "#5b9bd5", "#d9534f"


def _spans_by_row(records: SequenceLike[StepRecord], use_time: bool):
    "Row order (first appearance) and, per (sequence, kind), the x spans and chunk sizes of its work."
    rows: dict[int, int] = {}
    spans: dict[tuple[int, str], list[tuple[float, float, int]]] = {}
    marks: dict[str, list[tuple[float, int]]] = {"preempted": [], "finished": []}
    recomputing: set[int] = set()   # preempted, and not yet back to sampling
    for r in records:
        x0, x1 = r.span(use_time)
        for sid in r.preempted:
            rows.setdefault(sid, len(rows))
            recomputing.add(sid)
            marks["preempted"].append((x0, sid))
        for sid, n, prefill, sampled in zip(r.seq_ids, r.num_tokens, r.is_prefill, r.sampled):
            rows.setdefault(sid, len(rows))
            kind = "recompute" if sid in recomputing else "prefill" if prefill else "decode"
            spans.setdefault((sid, kind), []).append((x0, x1 - x0, n))
            if sampled:
                recomputing.discard(sid)
        marks["finished"] += [(x1, sid) for sid in r.finished]
    return rows, spans, marks


def draw_timeline(records: SequenceLike[StepRecord], axes=None, use_time: bool = False, budget: int | None = None,
                  title: str = "", label_chunks: bool | None = None, path: str | None = None):
    """Draw scheduler steps: per request, its prompt chunks, decodes and recomputes (x = preempted, dot = finished);
    below, tokens per step against the budget, and KV-cache occupancy. `axes`: three axes to draw into."""
    if not records:
        raise ValueError("draw_timeline needs at least one StepRecord")
    if axes is None:
        fig, axes = plt.subplots(3, 1, figsize=(11, 6), sharex=True, gridspec_kw=dict(height_ratios=[3, 1.2, 1]))
    ax_t, ax_n, ax_kv = axes
    rows, spans, marks = _spans_by_row(records, use_time)
    colors = {"prefill": PREFILL_COLOR, "decode": DECODE_COLOR, "recompute": RECOMPUTE_COLOR}
    label_chunks = len(records) <= 60 if label_chunks is None else label_chunks
    for (sid, kind), bars in spans.items():
        y = rows[sid]
        ax_t.broken_barh([(x, w) for x, w, _ in bars], (y - 0.35, 0.7), facecolors=colors[kind],
                         edgecolor="white", linewidth=0.3)
        if label_chunks and kind != "decode":
            for x, w, n in bars:
                ax_t.text(x + w / 2, y, str(n), ha="center", va="center", fontsize=6)
    for key, marker, color in [("preempted", "x", "black"), ("finished", "o", "black")]:
        if marks[key]:
            xs, sids = zip(*marks[key])
            ax_t.scatter(xs, [rows[s] for s in sids], marker=marker, s=22, color=color, zorder=3, linewidths=1.2)
    ax_t.set_yticks(range(len(rows)), [f"seq {sid}" for sid in rows] if len(rows) <= 40 else [""] * len(rows),
                    fontsize=7)
    ax_t.set_ylim(len(rows) - 0.5, -0.5)
    ax_t.set_title(title, fontsize=9, pad=18)
    ax_t.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()]
                + [Line2D([], [], marker="x", ls="", color="black", label="preempted"),
                   Line2D([], [], marker="o", ls="", color="black", label="finished")],
                fontsize=7, ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    xs = [r.span(use_time)[0] for r in records]
    ws = [r.span(use_time)[1] - r.span(use_time)[0] for r in records]
    pre = [sum(n for n, p in zip(r.num_tokens, r.is_prefill) if p) for r in records]
    dec = [sum(n for n, p in zip(r.num_tokens, r.is_prefill) if not p) for r in records]
    ax_n.bar(xs, dec, width=ws, align="edge", color=DECODE_COLOR, lw=0)
    ax_n.bar(xs, pre, width=ws, bottom=dec, align="edge", color=PREFILL_COLOR, lw=0)
    if budget:
        ax_n.axhline(budget, color="black", ls="--", lw=0.8)
    ax_n.set_ylabel("tokens", fontsize=8)
    ax_kv.bar(xs, [r.kv_usage for r in records], width=ws, align="edge", color="#8e7cc3", alpha=0.7, lw=0)
    ax_kv.set_ylim(0, 1.05)
    ax_kv.set_ylabel("KV used", fontsize=8)
    ax_kv.set_xlabel("time (s)" if use_time else "step", fontsize=8)
    fig = ax_t.figure
    if path:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig
