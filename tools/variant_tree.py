"""A copy of the package that differs from it in chosen ways, for `tools/ab_bench.py --tree NAME=DEST`: trials of
issue 52's small batches measured in the engine beside main, in one call, before any of them goes into the notebooks.

    python tools/variant_tree.py DEST --decode-launch-from SWEEP.json   # the fastest launch a sweep found, per batch
    python tools/variant_tree.py DEST --decode-launch 8=64,4,3,4        # batch=tile,warps,stages,splits (repeatable)
    python tools/variant_tree.py DEST --few-row 16     # 2 to 16 rows: tensor-core products launched early (below)
    python tools/variant_tree.py DEST --fused-gate-up 64   # 2 to 64 rows: gate/up product and SiLU in one kernel
    python tools/variant_tree.py DEST --tuned-few-rows PROBE.json  # the package's few-row products, the probe's tiles
    python tools/variant_tree.py DEST --pdl-max-rows 16   # every Triton kernel of a step of up to 16 rows starts early
    python tools/variant_tree.py DEST --src OTHER_TREE ...  # start from another tree (default: this repository)

The edits, each on a CUDA device only (a CPU run is the package's):
- `--decode-launch[-from]`: the decode kernel of a bfloat16 cache without a shared prefix (with the K/V write inside
  too, `rope_decode_attention`) takes this tile, warps, stages and splits at these batch sizes
  (`tools/decode_layers_sweep.py` writes SWEEP.json).
- `--few-row N`: products of 2 to N rows (not the LM head) take `tools/few_row_bench.py`'s kernels launched early:
  `dot` in 64 x 256 tiles where K <= 1,024 (qkv, gate/up), split-K in 8 otherwise (o, down), the fastest at 8 rows
  on an H100 (figures/52_few_row_splitk_h100.json); and every kernel of the package launches early up to N rows
  (`PDL_MAX_ROWS`), so the kernel before each product starts it early too.
- `--fused-gate-up N`: the MLP of 2 to N rows runs `tools/gate_up_silu_bench.py`'s fused kernel in 16 x 64 x 128
  tiles (8.0 against 9.1-9.3 us at 8 and 32 rows as graph replays, figures/52_gate_up_silu_graphs_h100.json).
- `--tuned-few-rows PROBE.json` (repeatable): the package's own few-row products (`kernels/few_rows.py`, on by default
  where kernels start early) at 2 to `--few-rows-max` rows (default 16), in the tile, warps, stages and L2 prefetch
  that `tools/few_row_chain_probe.py` found fastest (its PROBE.json's `best`) at the row count it swept
  (`--sweep-rows`): 8 rows' tiles for steps of up to 16 rows, 32 rows' for 17 to 32. The package's tiles are those it
  found on an H100 at 8 rows (figures/52_few_row_chain_probe_h100.json): this tries other cards' and 32 rows'. A
  tile with K slices (the probe's `--grid wide`) runs the probe's split-K kernel, copied beside the package.
- `--pdl-max-rows N`: every kernel of the package that can start early (`use_pdl`: the norms, the K/V write, the
  decode kernel and its merge) does so in steps of up to N rows, not only one, so that each few-row product's weights
  load while the kernel ahead runs and that kernel's own wait overlaps the one before it.
The tools' modules are copied to DEST's top level, beside `minivllm`, where the edited package imports them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent


def replace_once(path: Path, old: str, new: str) -> None:
    "Replace the one occurrence of `old` in `path` by `new`; an anchor that moved is an error, not a silent no-op."
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"variant_tree: expected one {old.strip()[:60]!r} in {path}, found {text.count(old)}")
    path.write_text(text.replace(old, new))


def best_launches(sweep: dict) -> dict[int, list[int]]:
    "The fastest (block_n, num_warps, num_stages, num_splits) of each batch size in a decode_layers_sweep results file."
    best: dict[int, dict] = {}
    for r in sweep["results"]:
        if r["batch"] not in best or r["us"] < best[r["batch"]]["us"]:
            best[r["batch"]] = r
    return {b: [r["block_n"], r["num_warps"], r["num_stages"], r["num_splits"]] for b, r in best.items()}


def edit_decode_launch(tree: Path, launches: dict[int, list[int]]) -> None:
    old = "    block_n, num_stages = block_n or tiles.block_n, num_stages or tiles.num_stages\n"
    new = (
        f"    trial = {launches!r}.get(batch) if q.is_cuda and not eight_bit and not cascade else None\n"
        "    if trial:  # (tools/variant_tree.py --decode-launch)\n"
        "        block_n, num_warps = block_n or trial[0], num_warps or trial[1]\n"
        "        num_stages, num_splits = num_stages or trial[2], num_splits or trial[3]\n"
    )
    replace_once(tree / "minivllm/kernels/paged_decode.py", old, new + old)
    fused = tree / "minivllm/kernels/rope_decode.py"  # a decode step with the K/V write inside: the same launches
    old = "    tiles = decode_tiles(batch, False, True, qkv.is_cuda)\n"
    new = (
        f"    trial = {launches!r}.get(batch) if qkv.is_cuda else None  # (tools/variant_tree.py --decode-launch)\n"
        "    tiles = type(tiles)(*trial[:3], tiles.per_sm) if trial else tiles\n"
    )
    replace_once(fused, old, old + new)
    replace_once(fused, "tiles.block_n, None, tiles.per_sm)", "tiles.block_n, trial and trial[3], tiles.per_sm)")


def edit_pdl_max_rows(tree: Path, rows: int) -> None:
    replace_once(tree / "minivllm/kernels/common.py", "PDL_MAX_ROWS = 1 ", f"PDL_MAX_ROWS = {rows} ")


def edit_few_row(tree: Path, rows: int) -> None:
    shutil.copy(TOOLS / "few_row_bench.py", tree / "few_row_bench.py")
    old = "    rows = 0 if packed is None else x.numel() // max(x.shape[-1], 1)"
    new = (
        f"    few = x.is_cuda and bias is None and x.dim() == 2 and 2 <= x.shape[0] <= {rows}\n"
        "    if few and weight.shape[0] <= 8192:  # (not the LM head)\n"
        "        import few_row_bench  # (tools/variant_tree.py --few-row)\n\n"
        "        if weight.shape[1] <= 1024:\n"
        "            return few_row_bench.dot_mm(x, weight, bn=64, bk=256, stages=4, pdl=True)\n"
        "        return few_row_bench.splitk_mm(x, weight, bn=64, bk=256, splits=8, pdl=True)\n"
    )
    replace_once(tree / "minivllm/layers/linear.py", old, new + old)
    edit_pdl_max_rows(tree, rows)


def edit_fused_gate_up(tree: Path, rows: int) -> None:
    for name in ("gate_up_silu_bench.py", "kernel_variants.py"):
        shutil.copy(TOOLS / name, tree / name)
    old = "        return self.down_proj(self.act_fn(gate_up(x)))\n"
    new = (
        f"        if x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= {rows} and gate_up.bias is None:\n"
        "            import gate_up_silu_bench  # (tools/variant_tree.py --fused-gate-up)\n\n"
        "            return self.down_proj(gate_up_silu_bench.gate_up_silu(x, gate_up.weight, (16, 64, 128, 4, 4)))\n"
    )
    replace_once(tree / "minivllm/models/qwen3.py", old, new + old)


PROBE_SHAPES = {  # the probe's products (Qwen3-0.6B): (outputs, inputs, norm inside, activation inside)
    "qkv": (4096, 1024, True, False),
    "o": (1024, 2048, False, False),
    "gate_up": (3072, 1024, True, True),
    "down": (1024, 3072, False, False),
}


def probe_tiles(*probes: dict) -> dict[int, dict[tuple, list[int]]]:
    """The probes' fastest (block_n, block_k, warps, stages, prefetch mode) per product, keyed by the launcher's
    block_m (16 for up to 16 rows, 32 for 17 to 32) and shape: only row counts a probe swept (`--sweep-rows`)."""
    tiles: dict[int, dict[tuple, list[int]]] = {}
    for probe in probes:
        for rows, r in probe["rows"].items():
            if "best" in r and any(key.startswith("sweep_") for key in r):
                block_m = max(16, 1 << (int(rows) - 1).bit_length())
                tiles[block_m] = {PROBE_SHAPES[name]: list(cfg) for name, cfg in r["best"].items()}
    if not tiles:
        raise SystemExit("variant_tree: the probe's results hold no swept `best` tiles (run it on a GPU)")
    return tiles


def edit_tuned_few_rows(tree: Path, tiles: dict[int, dict[tuple, list[int]]], most_rows: int) -> None:
    path = tree / "minivllm/kernels/few_rows.py"
    old = "    block_m = max(16, triton.next_power_of_2(m))\n"
    new = (
        "    block_m = max(16, triton.next_power_of_2(m))\n"
        f"    tuned = {tiles!r}.get(block_m, {{}}).get((n, k, norm, fuse_silu))  # (tools/variant_tree.py)\n"
        "    if tuned:\n"
        "        block_k = triton.next_power_of_2(k) if norm else min(tuned[1], triton.next_power_of_2(k))\n"
        "        return block_m, tuned[0], block_k, tuned[3], tuned[2]\n"
    )
    replace_once(path, old, new)
    prefetch = {(bm, *shape): cfg[4] == 2 for bm, shapes in tiles.items() for shape, cfg in shapes.items()}
    old = "        PREFETCH_L2=FEW_ROWS_L2 and pdl and k > block_k,\n"
    key = "(block_m, n, k, norm, fuse_silu)"
    new = f"        PREFETCH_L2=FEW_ROWS_L2 and pdl and {prefetch!r}.get({key}, k > block_k),\n"
    replace_once(path, old, new)
    replace_once(path, "FEW_ROWS_STEP_MAX = 16 ", f"FEW_ROWS_STEP_MAX = {most_rows} ")
    splits = {
        (bm, *shape): cfg
        for bm, shapes in tiles.items()
        for shape, cfg in shapes.items()
        if len(cfg) > 5 and cfg[5] > 1
    }
    if splits:  # the probe's split-K kernel for those products
        for name in ("few_row_chain_probe.py", "few_row_bench.py"):
            shutil.copy(TOOLS / name, tree / name)
        old = "    pdl = FEW_ROWS_PDL and use_pdl(x.device)\n"
        new = (
            f"    split = {splits!r}.get((block_m, n, k, norm, fuse_silu))\n"
            "    if split:  # (tools/variant_tree.py: the probe's split-K)\n"
            "        import few_row_chain_probe\n\n"
            "        few_row_chain_probe.splitk(x, weight, split, pdl, out=y)\n"
            "        return\n"
        )
        replace_once(path, old, old + new)


def make_tree(
    dest: Path,
    src: Path = ROOT,
    launches=None,
    few_row: int = 0,
    fused_gate_up: int = 0,
    tuned_few_rows: dict | None = None,
    few_rows_max: int = 16,
    pdl_max_rows: int = 0,
) -> Path:
    "Copy `src`'s package (without the embedded tiny model's data) to `dest` and apply the chosen edits."
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src / "minivllm", dest / "minivllm", ignore=shutil.ignore_patterns("data", "__pycache__"))
    if launches:
        edit_decode_launch(dest, launches)
    if few_row:
        edit_few_row(dest, few_row)
    if fused_gate_up:
        edit_fused_gate_up(dest, fused_gate_up)
    if tuned_few_rows:
        edit_tuned_few_rows(dest, tuned_few_rows, few_rows_max)
    if pdl_max_rows:
        edit_pdl_max_rows(dest, pdl_max_rows)
    edits = dict(decode_launch=launches or {}, few_row=few_row, fused_gate_up=fused_gate_up, src=str(src))
    edits["pdl_max_rows"] = pdl_max_rows
    if tuned_few_rows:
        edits["tuned_few_rows"] = {f"{bm} {shape}": cfg for bm, t in tuned_few_rows.items() for shape, cfg in t.items()}
        edits["few_rows_max"] = few_rows_max
    (dest / "variant.json").write_text(json.dumps(edits, indent=1))
    return dest


def parse_launch(text: str) -> tuple[int, list[int]]:
    batch, values = text.split("=")
    launch = [int(v) for v in values.split(",")]
    if len(launch) != 4:
        raise argparse.ArgumentTypeError(f"--decode-launch takes batch=tile,warps,stages,splits, got {text!r}")
    return int(batch), launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--src", type=Path, default=ROOT, help="the tree to copy (default: this repository)")
    ap.add_argument("--decode-launch", type=parse_launch, action="append", default=[], metavar="B=N,W,S,P")
    ap.add_argument("--decode-launch-from", type=Path, default=None, metavar="SWEEP.json")
    ap.add_argument("--few-row", type=int, default=0, metavar="N")
    ap.add_argument("--fused-gate-up", type=int, default=0, metavar="N")
    ap.add_argument("--tuned-few-rows", type=Path, action="append", default=[], metavar="PROBE.json")
    ap.add_argument("--few-rows-max", type=int, default=16, metavar="N")
    ap.add_argument("--pdl-max-rows", type=int, default=0, metavar="N")
    args = ap.parse_args()
    launches = best_launches(json.loads(args.decode_launch_from.read_text())) if args.decode_launch_from else {}
    launches.update(dict(args.decode_launch))
    tiles = probe_tiles(*(json.loads(p.read_text()) for p in args.tuned_few_rows)) if args.tuned_few_rows else None
    tree = make_tree(
        args.dest,
        args.src,
        launches,
        args.few_row,
        args.fused_gate_up,
        tiles,
        args.few_rows_max,
        args.pdl_max_rows,
    )
    print(f"{tree}: {(tree / 'variant.json').read_text()}")


if __name__ == "__main__":
    main()
