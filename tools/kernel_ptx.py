"""The attention kernels compiled for a Hopper GPU (sm_90) on any machine, and a count of chosen PTX instructions.

    python tools/kernel_ptx.py                      # every configuration, counts as JSON
    python tools/kernel_ptx.py --configs plain      # the plain decode step only
    python tools/kernel_ptx.py --prefill            # the prefill kernel at the launcher's defaults, register cap too

Triton compiles to PTX without a GPU. For each configuration (plain; split KV in a mixed step; cascade with early
launch) and each cache (bfloat16; 8-bit read as float16 tiles, F16_TILES; 8-bit read as bfloat16 tiles), the counts
of the instructions that tell how the tiles reach the tensor cores. The compiler is told what a launch on Qwen3's
shapes tells it (16-byte aligned pointers, strides divisible by 16: vectorized loads). Run it without
TRITON_INTERPRET: the interpreter replaces the compiled kernels. tests/test_kernel_compile.py and the 8-bit cache's
deep dive run it.
"""

from __future__ import annotations

import argparse
import json
import os

STRIDES = {"sq": 2, "so": 2, "sk": 3, "sv": 3}
SCALARS = ("num_splits", "num_parts", "stride_bt")  # not specialized (do_not_specialize)
DIVISIBLE_BY_16 = [["tt.divisibility", 16]]
CONFIGS = {
    "plain": dict(),
    "splits-mixed": dict(USE_SPLITS=True, MIXED=True),
    "cascade-pdl": dict(CASCADE=True, FOLD_PREFIX=True, PDL=True),
}
CACHES = {"bf16": ("*bf16", False), "fp8 as f16": ("*fp8e4nv", True), "fp8 as bf16": ("*fp8e4nv", False)}
COUNTED = ("mma.sync", ".f32.f16.f16.f32", "ld.shared.b8", "cvt.rn.f16x2.e4m3x2", "cvt.bf16.f16")


def hopper_ptx(cache: str, **flags) -> str:
    "PTX of the decode kernel for sm_90: bfloat16 queries over a cache of Triton type `cache` (Qwen3-0.6B's heads)."
    import triton
    from triton.backends.compiler import GPUTarget

    from minivllm.kernels.paged_decode_kernel import _paged_decode_kernel

    ptrs = dict(q_ptr="*bf16", out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32")
    ptrs.update(k_cache_ptr=cache, v_cache_ptr=cache)
    signature, attrs = {}, {}  # attrs: what a launch tells the compiler, pointers and strides divisible by 16
    for i, name in enumerate(_paged_decode_kernel.arg_names):
        if name.endswith("_ptr"):
            signature[name] = ptrs.get(name, "*i32")
            attrs[(i,)] = DIVISIBLE_BY_16
        elif name in STRIDES:
            signature[name] = ("i32",) * STRIDES[name]
            attrs.update({(i, j): DIVISIBLE_BY_16 for j in range(STRIDES[name])})
        elif name in SCALARS:
            signature[name] = "i32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "constexpr"
    constants = dict(NUM_Q_HEADS=16, GROUP=2, GROUP_PAD=16, HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=16, BLOCK_N=128)
    constants.update(USE_SPLITS=False, CASCADE=False, FOLD_PREFIX=False, MIXED=False, PDL=False, F16_TILES=False)
    constants.update(DOT_PRECISION="tf32", DOT_FP32=False, **flags)
    source = triton.compiler.ASTSource(fn=_paged_decode_kernel, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    return kernel.asm["ptx"]


PREFILL_COUNTED = ("wgmma.mma_async", "cp.async", ".maxnreg", "cvt.rn.f16x2.e4m3x2")


def prefill_ptx(cache: str) -> str:
    "PTX of the prefill kernel for sm_90 at the launcher's tiles and register cap: bfloat16 queries, a `cache` cache."
    import triton
    from triton.backends.compiler import GPUTarget

    from minivllm.kernels import paged_prefill as pp
    from minivllm.kernels.paged_prefill_kernel import _paged_prefill_kernel

    signature, attrs = {}, {}
    for i, name in enumerate(_paged_prefill_kernel.arg_names):
        if name.endswith("_ptr"):
            signature[name] = dict(out_ptr="*bf16", q_ptr="*bf16", k_ptr=cache, v_ptr=cache).get(name, "*i32")
            attrs[(i,)] = DIVISIBLE_BY_16
        elif name in STRIDES:
            signature[name] = ("i32",) * STRIDES[name]
            attrs.update({(i, j): DIVISIBLE_BY_16 for j in range(STRIDES[name])})
        elif name in ("num_seqs", "stride_bt"):
            signature[name] = "i32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "constexpr"
    block_m, block_q, _ = pp.plan_prefill(1024, 1, 16, 8)
    constants = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=16, BLOCK_Q=block_q, BLOCK_M=block_m)
    constants.update(BLOCK_N=pp.PREFILL_BLOCK_N, PAGED=True, SKIP_SINGLE=True, DOT_PRECISION="tf32", DOT_FP32=False)
    options = dict(num_warps=pp.PREFILL_NUM_WARPS, num_stages=pp.PREFILL_NUM_STAGES, maxnreg=pp.PREFILL_MAX_REGISTERS)
    source = triton.compiler.ASTSource(fn=_paged_prefill_kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def counts(configs: list[str]) -> dict:
    "For each configuration and cache, the count of each of COUNTED in the PTX."
    result = {}
    for name in configs:
        for cache, (ty, f16) in CACHES.items():
            ptx = hopper_ptx(ty, F16_TILES=f16, **CONFIGS[name])
            result[f"{name} {cache}"] = {op: ptx.count(op) for op in COUNTED}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--prefill", action="store_true", help="the prefill kernel instead, bfloat16 and 8-bit caches")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_ptx.py compiles the kernels: run it without TRITON_INTERPRET=1")
    if args.prefill:
        ptx = {cache: prefill_ptx(ty) for cache, ty in (("bf16", "*bf16"), ("fp8", "*fp8e4nv"))}
        print(json.dumps({cache: {op: p.count(op) for op in PREFILL_COUNTED} for cache, p in ptx.items()}))
        return
    print(json.dumps(counts(args.configs.split(","))))


if __name__ == "__main__":
    main()
