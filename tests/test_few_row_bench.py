"""tools/few_row_bench.py, the few-row product kernels measured against cuBLAS: on a CPU (Triton's interpreter) each
candidate kernel gives x @ W^T, for row counts on and off its tile sizes and with split-K."""

from __future__ import annotations

import pytest
import torch
from _tools import load_tool


@pytest.fixture(scope="module")
def bench():
    return load_tool("few_row_bench")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check; on a GPU the tool measures instead")
def test_every_candidate_kernel_gives_the_product(bench):
    g = torch.Generator().manual_seed(0)
    for m in (1, 3, 8, 20):
        x, w = torch.randn(m, 96, generator=g), torch.randn(80, 96, generator=g)
        want = x @ w.T
        for got in (bench.rows_mm(x, w, 4, 32), bench.dot_mm(x, w, 16, 32), bench.dot_mm(x, w, 16, 32, split=2)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
