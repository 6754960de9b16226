"""The decode and prefill kernels compile for a Hopper GPU (sm_90) on a machine without one (`tools/kernel_ptx.py`:
Triton compiles to PTX on the CPU). The interpreter, which runs the kernels in the other tests here, checks less than
the compiler (a jit function's returns must agree in type, for one), so a kernel that only the GPU would reject fails
here first. And the PTX shows what the 8-bit cache's deep dive teaches: e4m3 tiles become float16 in one instruction
per two bytes, and bfloat16 tiles take two more. The prefill kernel compiles at the launcher's tiles with its
register cap (`maxnreg`), which must reach the PTX for two programs to share an SM (deep dive 06, on the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "kernel_ptx.py"
CONFIGS = ["plain", "splits-mixed", "cascade-pdl"]


@pytest.fixture(scope="module")
def ptx_counts() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not the interpreter
    run = subprocess.run([sys.executable, str(TOOL)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", CONFIGS)
def test_decode_kernel_compiles_for_hopper_with_each_cache(ptx_counts, config):
    bf16, as_f16, as_bf16 = (ptx_counts[f"{config} {cache}"] for cache in ("bf16", "fp8 as f16", "fp8 as bf16"))
    assert bf16["mma.sync"] > 0 and bf16["cvt.rn.f16x2.e4m3x2"] == 0  # a 16-bit cache: tensor cores, no conversion
    pairs = as_f16["cvt.rn.f16x2.e4m3x2"]
    assert pairs > 0 and as_f16["cvt.bf16.f16"] == 0 and as_f16[".f32.f16.f16.f32"] > 0  # float16 products
    assert as_bf16["cvt.rn.f16x2.e4m3x2"] == pairs and as_bf16["cvt.bf16.f16"] == 2 * pairs


def test_prefill_kernel_compiles_for_hopper_under_its_register_cap():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(TOOL), "--prefill"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    for cache in ("bf16", "fp8"):
        assert counts[cache]["wgmma.mma_async"] > 0 and counts[cache][".maxnreg"] == 1  # Hopper's MMA; the cap
    assert counts["bf16"]["cvt.rn.f16x2.e4m3x2"] == 0 < counts["fp8"]["cvt.rn.f16x2.e4m3x2"]  # 8-bit tiles converted


def test_few_row_products_compile_for_hopper_without_spilling():
    "A product whose registers spilled to the stack took 200 times its time in a decode step: none may spill."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(TOOL), "--few-rows", "2,8,32"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    usage = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(usage) == 12 and all(u["registers"] > 0 for u in usage.values())
    assert {name: u["stack"] for name, u in usage.items() if u["stack"]} == {}


def test_the_tool_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(TOOL)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "without TRITON_INTERPRET" in run.stderr


def test_the_persistent_decode_probe_fits_one_program_an_sm(tmp_path):
    "tools/persistent_decode_probe.py waits at grid barriers: every program must be resident at once, one an SM."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = TOOL.parent / "persistent_decode_probe.py"
    out = tmp_path / "sm90.json"
    run = subprocess.run([sys.executable, str(probe), str(out), "--compile-only"], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    usage = json.loads(out.read_text())["sm90"]
    assert usage["registers"] * 256 <= 65536 and usage["shared"] <= 227 * 1024, usage  # 8 warps; an H100's SM
