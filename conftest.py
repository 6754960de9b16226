"""Shared pytest set-up for tests/ and for `pytest --nbval notebooks/`.

- Tests marked `gpu` are skipped where CUDA is not available.
- Notebook cells whose first line is `#| gpu` are skipped under nbval where CUDA is not available; they keep
  the outputs of a real GPU run (tools/run_notebooks.py leaves them alone on CPU in the same way).
- Nothing may reach the Hugging Face hub: everything runs offline from local folders.
- Figures a notebook saves (`minivllm.viz.figures.save_figure`) go to a temporary folder: a test run leaves the work
  tree as it was (`make notebooks` writes figures/).
- torch runs one thread (OMP_NUM_THREADS=1, unless set): here, in every notebook's kernel and in every process a test
  starts (a server, a client, a tensor-parallel rank). The tiny shapes gain little from more, and where the cores
  are busy (the other processes of a test, or a busy CI machine) threads that wait for each other are descheduled:
  a step several times slower. Outputs do not depend on it (tools/numerics_matrix.sh runs the suite on 1 and 4);
  tools/run_notebooks.py imports this file, so the outputs it stores come from the same setting.
"""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MINIVLLM_FIGURES", tempfile.mkdtemp(prefix="minivllm-figures-"))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # (before torch is imported: its thread pool reads it)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not cuda_available():
    # Triton reads this when a kernel is defined (at import), so it must be set before any test imports one: without
    # a GPU, every Triton kernel runs in Triton's CPU interpreter, whatever the order the test files run in.
    os.environ.setdefault("TRITON_INTERPRET", "1")

GPU_MARKER = "#| gpu"


def is_gpu_cell(source: str) -> bool:
    "A notebook cell that only runs on a CUDA machine: its first line is `#| gpu`."
    lines = source.lstrip().splitlines()
    return bool(lines) and lines[0].strip() == GPU_MARKER


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; the stored output comes from a real GPU run")
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is not None and is_gpu_cell(cell.source):
            item.add_marker(skip_gpu)
        elif item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
