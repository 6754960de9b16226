"""Helpers of the kernel-experiment tools (decode_kernel_edits.py, prefill_kernel_edits.py, decode_register_cap.py,
few_row_bench.py, gate_up_silu_bench.py, qkv_epilogue_bench.py): a kernel module's source imported again from a
temporary file, edited, a kernel launched with extra options, and few-row products timed in CUDA graphs."""

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


def time_in_graph(fn, weights: list) -> float:
    """Microseconds per call of `fn(w)`: one CUDA graph over every weight copy (more than the L2 cache holds, as a
    model's layers are), replayed by Triton's do_bench. Decode steps replay graphs: this is how their kernels run."""
    import torch
    import triton

    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return triton.testing.do_bench(graph.replay, warmup=10, rep=40) / len(weights) * 1000
