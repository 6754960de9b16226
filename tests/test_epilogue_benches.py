"""The GPU experiments' kernels, checked on a CPU (Triton's interpreter) before a GPU times them:
tools/gate_up_silu_bench.py (the MLP's product with its activation, plain and by tensor descriptors),
tools/qkv_epilogue_bench.py (the qkv product with the q/k norms, rotation and K/V write) and
tools/l2_prefetch_probe.py (its prefetch kernel visits every line of a tensor once) and
tools/persistent_decode_probe.py (a decode step's layers in one persistent kernel, against torch) and
tools/rope_decode_probe.py (the q/k norms, rotation and K/V write inside the decode kernel, against the pair)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter checks (TRITON_INTERPRET=1, set by conftest.py on a CPU); on a GPU the tools measure",
)


def tool(name: str):
    "Import tools/`name`.py as python runs it as a script: with tools/ first on the path (its shared helpers)."
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fused_gate_up_kernels_match_the_unfused_path():
    bench = tool("gate_up_silu_bench")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 128, generator=g) * 0.05).half()
    for m in (1, 37):
        x = (torch.randn(m, 128, generator=g) * 0.5).half()
        gate, up = (x.float() @ w.float().t()).half().float().chunk(2, dim=-1)
        want = (torch.nn.functional.silu(gate) * up).half()
        for fn in (bench.gate_up_silu, bench.gate_up_silu_tma):
            torch.testing.assert_close(fn(x, w, (32, 32, 32, 4, 2)), want, atol=1e-3, rtol=1e-3)


def test_the_qkv_epilogue_kernel_writes_what_qk_norm_rope_store_writes():
    bench = tool("qkv_epilogue_bench")
    args = bench.problem(37, (4, 2, 32), 64, "cpu", torch.float16)
    want = bench.run_both(args, bench.unfused)
    got = bench.run_both(args, bench.qkv_epilogue, (32, 32, 4, 2))
    assert want[1].abs().sum() > 0 and want[2].abs().sum() > 0  # keys and values were written
    for a, b in zip(got, want):  # queries, key cache, value cache
        torch.testing.assert_close(a, b, atol=4e-3, rtol=4e-3)


def test_the_prefetch_kernel_visits_every_line_once():
    probe = tool("l2_prefetch_probe")
    probe.check()


def test_the_persistent_decode_kernel_matches_its_torch_reference():
    probe = tool("persistent_decode_probe")
    for splits in (1, 2):  # one split: the output written at once; two: merged by the last split to finish
        for preload in (False, True):  # weight tiles read in chunks after each barrier, or held across it
            got = probe.check(probe.TINY, "cpu", torch.float32, 3, 40, 16, splits, block_n=16, preload=preload)
            assert got["err"] == 0, got
            assert max(got["h"], got["k"], got["v"]) < 1e-5, got


@pytest.mark.parametrize("batch", [1, 3])
def test_the_rope_decode_probe_compares_the_one_kernel_with_the_pair(batch):
    got = tool("rope_decode_probe").check(batch, 40, torch.device("cpu"))  # 40 positions: the last split writes
    assert got["k_written"] > 0 and got["out_scale"] > 0  # the pair wrote the new key; attention read something
    assert got["out"] == got["k"] == got["v"] == 0.0, got  # float16: the same roundings in the same order
