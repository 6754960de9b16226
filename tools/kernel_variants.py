"""Helpers of the kernel-experiment tools (decode_kernel_edits.py, prefill_kernel_edits.py, decode_register_cap.py):
a kernel module's source imported again from a temporary file, edited, and a kernel launched with extra options."""

from __future__ import annotations

import importlib.util
import os
import tempfile


def kernel_source(path: str) -> str:
    "A minivllm.kernels module's source with its relative imports made absolute (to import it from elsewhere)."
    return open(path).read().replace("from .", "from minivllm.kernels.")


def import_source(src: str, name: str):
    "The module that `src` defines, imported from a temporary file named `name`.py (Triton reads jit sources there)."
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class WithOptions:
    "A kernel launched with extra compile options (`maxnreg`: a register cap, so that more programs fit an SM)."

    def __init__(self, kernel, **options):
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, **self.options)
