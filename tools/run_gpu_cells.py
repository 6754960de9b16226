"""Run selected `#| gpu` cells of a notebook on a CUDA machine without Jupyter, and store their printed output.

    python tools/run_gpu_cells.py notebooks/06_attention_kernels.ipynb --match bench_fused_moe --out gpu_cells.json
    python tools/run_gpu_cells.py notebooks/06_attention_kernels.ipynb --merge gpu_cells.json    # back here
    python tools/run_gpu_cells.py notebooks/13_qwen3_on_gpu.ipynb --match gpu_llm --setup "cpu_outputs = " --out c.json

For self-contained GPU cells (their imports inside): each matching cell runs in a fresh namespace with `torch`
imported, its stdout is captured as the cell's stream output, and `--merge` writes those outputs into the same cells
(matched by source) of the notebook, as `tools/run_notebooks.py --gpu-outputs-from` does for whole notebooks.
GPU cells that build on CPU cells before them: `--setup TEXT` also runs the CPU cells whose source contains TEXT (in
notebook order, their output not kept), and then every cell shares one namespace.
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


def run_cells(path: Path, match: str, setup: list[str] = ()) -> list[dict]:
    """Execute the GPU cells of `path` whose source contains `match` (after the CPU cells containing one of `setup`,
    all in one namespace then); their sources and printed text (no Jupyter)."""
    import torch

    results, shared = [], {"__name__": "__main__", "torch": torch}
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code":
            continue
        gpu = is_gpu_cell(source) and match in source
        if not gpu and not any(text in source for text in setup):
            continue
        buffer = io.StringIO()
        namespace = shared if setup else {"__name__": "__main__", "torch": torch}
        with contextlib.redirect_stdout(buffer):
            exec(compile(source, f"<{path.name} cell {cell.get('id')}>", "exec"), namespace)
        if gpu:
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
    ap.add_argument(
        "--setup",
        action="append",
        default=[],
        help="first run the CPU cells whose source contains this text (repeatable; one shared namespace)",
    )
    args = ap.parse_args()
    if args.merge:
        print(f"{merge(args.notebook, json.loads(args.merge.read_text()))} cells updated")
    else:
        args.out.write_text(json.dumps(run_cells(args.notebook, args.match, args.setup), indent=1))


if __name__ == "__main__":
    main()
