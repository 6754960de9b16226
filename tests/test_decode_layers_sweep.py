"""tools/decode_layers_sweep.py, the decode kernel's launch configurations at small batches: on a CPU (Triton's
interpreter) every tile, warp, stage and split choice the sweep times gives the engine's output."""

from __future__ import annotations

import pytest
import torch
from _tools import load_tool


@pytest.fixture(scope="module")
def sweep():
    return load_tool("decode_layers_sweep")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check; on a GPU the tool measures instead")
def test_every_configuration_gives_the_engines_output(sweep):
    case = sweep.layered_case(batch=1, context=96, layers=2, device="cpu")
    assert len(case["k"]) == 2 and case["bytes_per_layer"] == 2 * 96 * 8 * 128 * 2
    ref = sweep.first_layer(case, {})
    for cfg in (
        dict(block_n=32, num_warps=4, num_stages=2, num_splits=1),
        dict(block_n=64, num_warps=8, num_stages=3, num_splits=4),
        dict(block_n=128, num_warps=4, num_stages=2, num_splits=2),
    ):
        torch.testing.assert_close(sweep.first_layer(case, cfg), ref, atol=2e-2, rtol=0)
