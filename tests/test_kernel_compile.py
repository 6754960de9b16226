"""The decode kernel compiles for a Hopper GPU (sm_90) on a machine without one (Triton compiles to PTX on the CPU).
The interpreter, which runs the kernels in the other tests here, checks less than the compiler (a jit function's
returns must agree in type, for one), so a kernel that only the GPU would reject fails here first. And the PTX shows
what deep dive 06 (the 8-bit cache) teaches: e4m3 tiles become float16 in one instruction per two bytes, bfloat16
tiles take two more."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STRIDES = {"sq": 2, "so": 2, "sk": 3, "sv": 3}
SCALARS = ("num_splits", "num_parts", "stride_bt")


FLAGS = {
    "plain": dict(),
    "splits-mixed": dict(USE_SPLITS=True, MIXED=True),
    "cascade-pdl": dict(CASCADE=True, FOLD_PREFIX=True, PDL=True),
}
COUNTED = ("mma.sync", ".f32.f16.f16.f32", "cvt.rn.f16x2.e4m3x2", "cvt.bf16.f16")


def hopper_ptx(cache: str, **flags) -> str:
    "PTX of the decode kernel for sm_90: bfloat16 queries over a cache of Triton type `cache` (Qwen3-0.6B's heads)."
    import triton
    from triton.backends.compiler import GPUTarget

    from minivllm.kernels.paged_decode_kernel import _paged_decode_kernel

    ptrs = dict(q_ptr="*bf16", out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32")
    ptrs.update(k_cache_ptr=cache, v_cache_ptr=cache)
    signature = {}
    for name in _paged_decode_kernel.arg_names:
        if name in ptrs:
            signature[name] = ptrs[name]
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        elif name in STRIDES:
            signature[name] = ("i32",) * STRIDES[name]
        elif name in SCALARS:
            signature[name] = "i32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "constexpr"
    constants = dict(NUM_Q_HEADS=16, GROUP=2, GROUP_PAD=16, HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=16, BLOCK_N=128)
    constants.update(USE_SPLITS=False, CASCADE=False, FOLD_PREFIX=False, MIXED=False, PDL=False, F16_TILES=False)
    constants.update(DOT_PRECISION="tf32", DOT_FP32=False, **flags)
    source = triton.compiler.ASTSource(fn=_paged_decode_kernel, signature=signature, constexprs=constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    return kernel.asm["ptx"]


def counts() -> dict:
    "Each configuration's counts of COUNTED in its PTX (run in a process without TRITON_INTERPRET: compiled kernels)."
    caches = {"bf16": ("*bf16", False), "fp8 as f16": ("*fp8e4nv", True), "fp8 as bf16": ("*fp8e4nv", False)}
    result = {}
    for name, flags in FLAGS.items():
        for cache, (ty, f16) in caches.items():
            ptx = hopper_ptx(ty, F16_TILES=f16, **flags)
            result[f"{name} {cache}"] = {op: ptx.count(op) for op in COUNTED}
    return result


@pytest.fixture(scope="module")
def ptx_counts() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", list(FLAGS))
def test_decode_kernel_compiles_for_hopper_with_each_cache(ptx_counts, flags):
    bf16, as_f16, as_bf16 = (ptx_counts[f"{flags} {cache}"] for cache in ("bf16", "fp8 as f16", "fp8 as bf16"))
    assert bf16["mma.sync"] > 0 and bf16["cvt.rn.f16x2.e4m3x2"] == 0  # a 16-bit cache: tensor cores, no conversion
    pairs = as_f16["cvt.rn.f16x2.e4m3x2"]
    assert pairs > 0 and as_f16["cvt.bf16.f16"] == 0 and as_f16[".f32.f16.f16.f32"] > 0  # float16 products
    assert as_bf16["cvt.rn.f16x2.e4m3x2"] == pairs and as_bf16["cvt.bf16.f16"] == 2 * pairs


if __name__ == "__main__":
    print(json.dumps(counts()))
