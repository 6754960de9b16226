"""Re-execute notebooks in place and store their outputs, as `pytest --nbval` will later compare them.

    python tools/run_notebooks.py notebooks/03_scheduler.ipynb [more.ipynb ...]
    python tools/run_notebooks.py --gpu-outputs-from DIR notebooks/05_paged_attention.ipynb   # after a GPU run

Cells whose first line is `#| gpu` run only where CUDA is available; elsewhere they are skipped and keep
the outputs stored from a real GPU run (the root conftest.py skips them under nbval the same way).
Each notebook runs in a fresh kernel of the current Python, from the notebook's own folder. The figures it saves go to
the repository's figures/ (the test suite sends them to a temporary folder instead).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["MINIVLLM_FIGURES"] = str(Path(__file__).resolve().parents[1] / "figures")
from conftest import cuda_available, is_gpu_cell  # noqa: E402


def run_notebook(path: Path, timeout: int = 1800, gpu: bool | None = None) -> None:
    "Execute `path` cell by cell in a fresh kernel and write it back with its new outputs."
    gpu = cuda_available() if gpu is None else gpu
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    count = 0
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if is_gpu_cell(cell.source) and not gpu:
                print(f"  cell {index}: GPU only, kept its stored output")
                continue
            client.execute_cell(cell, index, execution_count=count + 1)
            count += 1
        client.set_widgets_metadata()  # the widgets' state, so a player shows its controls before the kernel runs
    nbformat.write(nb, path)
    print(f"ran {path} ({count} cells)")


def is_widget_view(output) -> bool:
    return "application/vnd.jupyter.widget-view+json" in output.get("data", {})


def merge_gpu_outputs(path: Path, gpu_run: Path) -> int:
    """Copy the outputs of the `#| gpu` cells of `gpu_run` (the same notebook, executed on a GPU machine) into the
    notebook at `path`, matching cells by their source; the CPU cells keep their CPU outputs. Returns the cells
    updated."""
    nb, ran = nbformat.read(path, as_version=4), nbformat.read(gpu_run, as_version=4)
    by_source = {c.source: c for c in ran.cells if c.cell_type == "code"}
    updated = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and is_gpu_cell(cell.source):
            twin = by_source.get(cell.source)
            if twin is None:
                raise ValueError(
                    f"{path.name}: GPU cell {cell.get('id')} has no twin with the same source in {gpu_run}"
                )
            cell.outputs = [o for o in twin.outputs if not is_widget_view(o)]  # (a progress bar's widget state
            cell.execution_count = twin.execution_count  # stays behind: its text would do)
            updated += 1
    nbformat.write(nb, path)
    return updated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    ap.add_argument(
        "--gpu-outputs-from",
        type=Path,
        default=None,
        help="a folder of the same notebooks executed on a GPU: copy their GPU cells' outputs here",
    )
    args = ap.parse_args()
    for nb in args.notebooks:
        if args.gpu_outputs_from:
            print(f"{nb}: {merge_gpu_outputs(nb, args.gpu_outputs_from / nb.name)} GPU cells updated")
        else:
            run_notebook(nb, args.timeout)


if __name__ == "__main__":
    main()
