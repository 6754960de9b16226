"""Helpers of the kernel-experiment tools (decode_kernel_edits.py, prefill_kernel_edits.py, decode_register_cap.py,
few_row_bench.py, gate_up_silu_bench.py, qkv_epilogue_bench.py): a kernel module's source imported again from a
temporary file, edited, a kernel launched with extra options, products' tiles in grouped order, few-row products
timed in CUDA graphs, and results files."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile

import triton
import triton.language as tl


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


def graph_rows(tokens: int, candidates: list, weights: list, results: list) -> None:
    "Time each `(label, fn, config)` in a CUDA graph over `weights` (`time_in_graph`); a printed row each in `results`."
    for label, fn, config in candidates:
        row = dict(tokens=tokens, label=label, config=config, us=time_in_graph(fn, weights), graphs=True)
        results.append(row)
        print(json.dumps(row), flush=True)


def save_results(out: str | None, results: list) -> None:
    "The card's environment and `results`, as a results file at `out` (nothing without one)."
    from minivllm.bench import environment

    if out:
        with open(out, "w") as f:
            json.dump(dict(environment=environment(), results=results), f, indent=1)


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    "Program `pid`'s (row block, column block): GROUP_M row blocks take turns over a column block (its weights in L2)."
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_n)) % size_m, (pid % (GROUP_M * num_n)) // size_m
