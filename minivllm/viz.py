from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence as SequenceLike

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import to_rgba
from matplotlib.patches import Patch, Rectangle

from .engine.block_manager import BlockManager
from .engine.sequence import Sequence

FREE_CACHED_COLOR = "#d9d9d9"


_PALETTE = [c for i, c in enumerate(plt.cm.tab10.colors) if i != 7]  # tab10 without its grey (grey = free)


def seq_color(seq_id: int, alpha: float = 1.0) -> tuple:
    "A stable colour per sequence id, shared by every picture of the course."
    return (*_PALETTE[seq_id % len(_PALETTE)], alpha)


def _save(fig, path: str | None):
    if path:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig

# %%
def draw_fragmentation(lengths: list[int], max_model_len: int, block_size: int, ax=None, path: str | None = None):
    "Per request: tokens used, KV slots held by a contiguous max_model_len reservation, and by paging."
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(9, 3.2))
    xs = range(len(lengths))
    paged = [math.ceil(n / block_size) * block_size for n in lengths]
    ax.bar(xs, [max_model_len] * len(lengths), color="#f4cccc", edgecolor="#cc4125", label="contiguous reservation")
    ax.bar(xs, paged, color="#c9daf8", edgecolor="#3c78d8", label=f"paged (blocks of {block_size})")
    ax.bar(xs, lengths, width=0.5, color="#3c78d8", label="tokens used")
    used, reserved = sum(lengths), max_model_len * len(lengths)
    ax.set_title(f"KV slots per request: reservation wastes {1 - used / reserved:.0%}, "
                 f"paging {1 - used / sum(paged):.1%}")
    ax.set_xticks(list(xs), [f"req {i}" for i in xs])
    ax.set_ylabel("KV slots (tokens)")
    ax.legend(loc="upper right", fontsize=8, ncols=3)
    ax.set_ylim(0, max_model_len * 1.25)
    return _save(fig, path)

# %%
@dataclass
class KVSnapshot:
    "The KV cache's bookkeeping at one moment, as plain data (what `draw_kv_cache` draws; a recording is a list)."
    label: str
    block_size: int
    ref_counts: list[int]                                       # per physical block; 0 = free
    cached: list[bool]                                          # per physical block: in the prefix cache
    free_order: list[int] = field(default_factory=list)         # free block ids, next to be reused first
    tables: dict[int, list[int]] = field(default_factory=dict)  # sequence id -> block table
    num_tokens: dict[int, int] = field(default_factory=dict)    # sequence id -> tokens its table holds

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def usage(self) -> float:
        return sum(r > 0 for r in self.ref_counts) / self.num_blocks


def take_snapshot(block_manager: BlockManager, seqs: Iterable[Sequence], label: str = "") -> KVSnapshot:
    "Copy what the pictures need from a block manager and the sequences holding its blocks."
    seqs = list(seqs)
    return KVSnapshot(label, block_manager.block_size,
                      [b.ref_count for b in block_manager.blocks], [b.hash != -1 for b in block_manager.blocks],
                      list(block_manager.free_blocks), {s.seq_id: list(s.block_table) for s in seqs},
                      {s.seq_id: min(s.num_tokens, len(s.block_table) * s.block_size) for s in seqs})


def _block_owners(snap: KVSnapshot) -> tuple[list[list[int]], list[int]]:
    "Per physical block: the sequences holding it, and how many of its slots hold tokens."
    owners = [[] for _ in range(snap.num_blocks)]
    fill = [snap.block_size if c else 0 for c in snap.cached]
    for sid, table in snap.tables.items():
        for i, b in enumerate(table):
            owners[b].append(sid)
            fill[b] = max(fill[b], min(snap.block_size, snap.num_tokens[sid] - i * snap.block_size))
    return owners, fill

# %%
def _draw_block(ax, x, y, owners, cached, ref_count, fill, block_size, label, reuse_rank=None):
    "One square: owners' colours in stripes, hatched when free but cached, a fill bar, the block id."
    if owners:
        w = 0.9 / len(owners)
        for k, sid in enumerate(owners):
            ax.add_patch(Rectangle((x + k * w, y), w, 0.9, facecolor=seq_color(sid, 0.75), lw=0))
    elif cached:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=FREE_CACHED_COLOR, hatch="///", edgecolor="#999999", lw=0))
    ax.add_patch(Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor="black" if ref_count > 1 else "#666666",
                           lw=2.2 if ref_count > 1 else 0.8))
    if fill:
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.8 * fill / block_size, 0.1, facecolor="black", lw=0))
    ax.text(x + 0.45, y + 0.5, label, ha="center", va="center", fontsize=8)
    if ref_count > 1:
        ax.text(x + 0.86, y + 0.8, f"x{ref_count}", ha="right", va="center", fontsize=6, fontweight="bold")
    if cached:
        ax.text(x + 0.05, y + 0.8, "c", ha="left", va="center", fontsize=6, style="italic")
    if reuse_rank is not None:
        ax.text(x + 0.86, y + 0.22, f"#{reuse_rank}", ha="right", va="center", fontsize=5, color="#555555")


def _draw_pool_compact(ax, snap: KVSnapshot, owners: list[list[int]], per_row: int) -> None:
    "Thousands of blocks: one cell each, no text (owner's colour, black = shared, grey = free but cached)."
    rows = math.ceil(snap.num_blocks / per_row)
    img = np.zeros((rows, per_row, 4))
    for b in range(snap.num_blocks):
        img[b // per_row, b % per_row] = ((0, 0, 0, 1) if len(owners[b]) > 1 else seq_color(owners[b][0])
                                          if owners[b] else to_rgba(FREE_CACHED_COLOR) if snap.cached[b]
                                          else (1, 1, 1, 1))
    ax.imshow(img, interpolation="nearest", aspect="auto")
    ax.add_patch(Rectangle((-0.5, -0.5), per_row, rows, fill=False, edgecolor="#666666", lw=0.8))
    ax.set_xlim(-0.6, per_row - 0.4)
    ax.set_ylim(rows - 0.4, -0.6)


def draw_kv_cache(snap: KVSnapshot, ax=None, blocks_per_row: int | None = None, compact: bool | None = None,
                  path: str | None = None):
    """Block tables (one row per sequence) above the physical pool (one square per block): owners' colours, shared
    blocks outlined with their ref count, free-but-cached blocks hatched grey, `c` = in the prefix cache,
    `#k` = k-th free block to be reused, bars = slots holding tokens. With many blocks or sequences (`compact`,
    automatic above 256 blocks or 24 sequences), only the pool is drawn, one small cell per block."""
    owners, fill = _block_owners(snap)
    compact = snap.num_blocks > 256 or len(snap.tables) > 24 if compact is None else compact
    if compact:
        per_row = blocks_per_row or math.ceil(math.sqrt(snap.num_blocks * 4))
        if ax is None:
            fig, ax = plt.subplots(figsize=(9, 9 * math.ceil(snap.num_blocks / per_row) / per_row + 1))
        _draw_pool_compact(ax, snap, owners, per_row)
    else:
        per_row = blocks_per_row or min(snap.num_blocks, 16)
        pool_rows = math.ceil(snap.num_blocks / per_row)
        width = max(per_row, 2 + max((len(t) for t in snap.tables.values()), default=0))
        height = len(snap.tables) + pool_rows + 1.6
        if ax is None:
            fig, ax = plt.subplots(figsize=(0.55 * width + 0.6, 0.55 * height + 0.6))
        y = 0.0
        for sid, table in snap.tables.items():   # block tables, top rows
            y -= 1
            ax.text(-0.1, y + 0.45, f"seq {sid}", ha="right", va="center", fontsize=8, color=seq_color(sid))
            for i, b in enumerate(table):
                ax.add_patch(Rectangle((i, y), 0.9, 0.9, facecolor=seq_color(sid, 0.35),
                                       edgecolor="black", lw=2.2 if snap.ref_counts[b] > 1 else 0.6))
                ax.text(i + 0.45, y + 0.45, str(b), ha="center", va="center", fontsize=8)
        y -= 0.6
        ax.text(-0.1, y - 0.45, "pool", ha="right", va="center", fontsize=8)
        rank = {b: k + 1 for k, b in enumerate(snap.free_order)}
        for b in range(snap.num_blocks):          # the physical pool
            x, yy = b % per_row, y - 1 - b // per_row
            _draw_block(ax, x, yy, owners[b], snap.cached[b], snap.ref_counts[b], fill[b], snap.block_size, str(b),
                        rank.get(b))
        ax.set_xlim(-1.6, width + 0.1)
        ax.set_ylim(y - pool_rows - 0.2, 0.2)
        ax.set_aspect("equal")
    ax.axis("off")
    used = sum(r > 0 for r in snap.ref_counts)
    ax.set_title(f"{snap.label}\n{used}/{snap.num_blocks} blocks in use ({len(snap.tables)} sequences), "
                 f"{sum(snap.cached)} cached", fontsize=9)
    shared = (Patch(facecolor="black", label="shared") if compact
              else Patch(facecolor="white", edgecolor="black", lw=2.2, label="shared"))
    ax.legend(handles=[Patch(facecolor="white", edgecolor="#666666", label="free"),
                       Patch(facecolor=FREE_CACHED_COLOR, hatch="///", edgecolor="#999999", label="free, cached"),
                       shared], loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=3, fontsize=7, frameon=False)
    return _save(ax.figure, path)

# %%
def kv_cache_player(snapshots: SequenceLike[KVSnapshot], interval_ms: int = 900, **draw_kwargs):
    "An ipywidgets slider (and play button) that steps through a recording of `KVSnapshot`s."
    import ipywidgets as widgets
    from IPython.display import display

    if not snapshots:
        raise ValueError("kv_cache_player needs at least one snapshot")
    out = widgets.Output()
    slider = widgets.IntSlider(value=0, min=0, max=len(snapshots) - 1, description="snapshot")
    play = widgets.Play(value=0, min=0, max=len(snapshots) - 1, interval=interval_ms)
    widgets.jslink((play, "value"), (slider, "value"))

    def show(_=None):
        with out:
            out.clear_output(wait=True)
            fig = draw_kv_cache(snapshots[slider.value], **draw_kwargs)
            display(fig)
            plt.close(fig)

    slider.observe(show, names="value")
    show()
    return widgets.VBox([widgets.HBox([play, slider]), out])
