"""Run selected `#| gpu` cells of a notebook on a CUDA machine without Jupyter, and store their printed output.

    python tools/run_gpu_cells.py notebooks/06_attention_kernels.ipynb --match bench_fused_moe --out gpu_cells.json
    python tools/run_gpu_cells.py notebooks/06_attention_kernels.ipynb --merge gpu_cells.json    # back here

For self-contained GPU cells (their imports inside): each matching cell runs in a fresh namespace with `torch`
imported, its stdout is captured as the cell's stream output, and `--merge` writes those outputs into the same cells
(matched by source) of the notebook, as `tools/run_notebooks.py --gpu-outputs-from` does for whole notebooks.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import is_gpu_cell  # noqa: E402


def run_cells(path: Path, match: str) -> list[dict]:
    "Execute the GPU cells of `path` whose source contains `match`; their sources and printed text (no Jupyter)."
    import torch
    results = []
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and is_gpu_cell(source) and match in source:
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                exec(compile(source, f"<{path.name} cell {cell.get('id')}>", "exec"), {"__name__": "__main__", "torch": torch})
            results.append(dict(source=source, text=buffer.getvalue()))
            print(buffer.getvalue(), end="", file=sys.__stdout__)
    return results


def merge(path: Path, results: list[dict]) -> int:
    "Store each result's text as the output of the cell of `path` with the same source."
    import nbformat
    nb, updated = nbformat.read(path, as_version=4), 0
    by_source = {r["source"]: r["text"] for r in results}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source in by_source:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=by_source[cell.source])]
            updated += 1
    nbformat.write(nb, path)
    return updated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", type=Path)
    ap.add_argument("--match", default="", help="run the GPU cells whose source contains this text")
    ap.add_argument("--out", type=Path, help="write the outputs here (JSON)")
    ap.add_argument("--merge", type=Path, help="a JSON file of outputs to store in the notebook")
    args = ap.parse_args()
    if args.merge:
        print(f"{merge(args.notebook, json.loads(args.merge.read_text()))} cells updated")
    else:
        args.out.write_text(json.dumps(run_cells(args.notebook, args.match), indent=1))


if __name__ == "__main__":
    main()
