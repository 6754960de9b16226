"""The attention kernels compiled for a Hopper GPU (sm_90) on any machine, and a count of chosen PTX instructions.

    python tools/kernel_ptx.py                      # every configuration, counts as JSON
    python tools/kernel_ptx.py --configs plain      # the plain decode step only
    python tools/kernel_ptx.py --prefill            # the prefill kernel at the launcher's defaults, register cap too
    python tools/kernel_ptx.py --few-rows           # the few-row products at their tiles: registers and stack a thread

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


FEW_ROW_PRODUCTS = {  # Qwen3-0.6B's products of a decoder layer at a few rows: (outputs, K, norm, fuse_silu)
    "qkv": (4096, 1024, True, False),
    "o": (1024, 2048, False, False),
    "gate_up": (3072, 1024, True, True),
    "down": (1024, 3072, False, False),
}


def few_rows_usage(rows: int, n: int, k: int, norm: bool, fuse_silu: bool) -> dict:
    """The few-row product's kernel compiled to a Hopper cubin at the launcher's tiles (bfloat16): the registers and
    the stack a thread takes, as cuobjdump reports them (a stack means spilled registers)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from minivllm.kernels.few_rows import _few_rows_kernel, few_rows_tiles

    block_m, block_n, block_k, stages, warps = few_rows_tiles(rows, n, k, norm, fuse_silu)
    signature, attrs = {}, {}
    for i, name in enumerate(_few_rows_kernel.arg_names):
        if name.endswith("_ptr") or name in ("N", "K", "stride_x"):
            signature[name] = "*bf16" if name.endswith("_ptr") else "i32"
            attrs[(i,)] = DIVISIBLE_BY_16
        else:
            signature[name] = {"M": "i32", "eps": "fp32"}.get(name, "constexpr")
    constants = dict(NORM=norm, HAS_RESIDUAL=norm, FUSE_SILU=fuse_silu, BLOCK_M=block_m, BLOCK_N=block_n)
    constants.update(BLOCK_K=block_k, PREFETCH_L2=k > block_k, PDL=True, DOT_FP32=False, DOT_PRECISION="tf32")
    source = triton.compiler.ASTSource(fn=_few_rows_kernel, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps, num_stages=stages))
    return {"tiles": [block_m, block_n, block_k, stages, warps], **cubin_usage(kernel)}


def cubin_usage(kernel) -> dict:
    "A compiled kernel's registers and stack a thread, as cuobjdump reports them (a stack means spilled registers)."
    import subprocess
    import tempfile

    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    usage = {key: int(line.split(key + ":")[1].split()[0]) for key in ("REG", "STACK")}
    return {"registers": usage["REG"], "stack": usage["STACK"]}


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
    ap.add_argument("--few-rows", default=None, help="the few-row products at these row counts instead (e.g. 8,32)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_ptx.py compiles the kernels: run it without TRITON_INTERPRET=1")
    if args.few_rows:
        usage = {}
        for rows in map(int, args.few_rows.split(",")):
            for name, shape in FEW_ROW_PRODUCTS.items():
                usage[f"{name} {rows}"] = few_rows_usage(rows, *shape)
        print(json.dumps(usage))
        return
    if args.prefill:
        ptx = {cache: prefill_ptx(ty) for cache, ty in (("bf16", "*bf16"), ("fp8", "*fp8e4nv"))}
        print(json.dumps({cache: {op: p.count(op) for op in PREFILL_COUNTED} for cache, p in ptx.items()}))
        return
    print(json.dumps(counts(args.configs.split(","))))


if __name__ == "__main__":
    main()
