"""Few-row products y = x W^T, x [M, K] for M = 1 to 32, on Qwen3-0.6B's layer shapes: cuBLAS against Triton kernels.

    python tools/few_row_bench.py OUT.json          # on a GPU: every candidate, CUDA graphs of 24 weight copies
    python tools/few_row_bench.py OUT.json --rows 8,32 --kinds splitk,dot   # some row counts and kernels
    TRITON_INTERPRET=1 python tools/few_row_bench.py x.json   # on a CPU: the kernels against x @ W^T

Candidates: notebook 06's `gemv` (one row); `rows`, gemv's loop over rows (each weight tile loaded once for all M
rows, CUDA cores); `rows2`, all M rows against a weight tile at once (CUDA cores); `dot`, tensor-core tiles with M
padded to 16 (and split-K by atomic adds); `splitk`, tensor-core tiles over a slice of K each, summed in the same
launch by the last program of each column block to finish; each with and without early launch (PDL). The weights
rotate through 24 copies, more than the L2 cache holds, as a model's layers do. The question it answers: would a
few-row kernel of our own beat cuBLAS at batch 2 to 32 (it does not by much: about 6 us a product at any size, a floor
of launch and memory latency; with early launch, 1 to 1.6 us less at 8 rows)."""

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from minivllm.kernels.common import pdl_launch_next, pdl_wait


@triton.jit
def _rows_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_launch_next(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w = tl.load(
        w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0
    ).to(tl.float32)
    pdl_wait(PDL)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if k0 > 0:
            w = tl.load(
                w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :], other=0.0
            ).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + m * K + kk, mask=(kk < K) & (m < M), other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    tl.store(
        y_ptr + rows[:, None] * N + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows < M)[:, None] & (n < N)[None, :],
    )


@triton.jit
def _dot_slice(
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    K_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    "Column block program_id(0), K slice program_id(1): its float32 product [BLOCK_M, BLOCK_N], rows, columns, mask."
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * K_SPLIT
    kk = start + k
    w = tl.load(w_ptr + n[None, :].to(tl.int64) * K + kk[:, None], mask=(n < N)[None, :] & (kk < K)[:, None], other=0.0)
    pdl_wait(PDL)
    x = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=(rows < M)[:, None] & (kk < K)[None, :], other=0.0)
    acc = tl.dot(x, w)
    for k0 in range(start + BLOCK_K, start + K_SPLIT, BLOCK_K):
        kk = k0 + k
        w = tl.load(
            w_ptr + n[None, :].to(tl.int64) * K + kk[:, None], mask=(n < N)[None, :] & (kk < K)[:, None], other=0.0
        )
        x = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=(rows < M)[:, None] & (kk < K)[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
    mask = (rows < M)[:, None] & (n < N)[None, :]
    return acc, rows, n, mask


@triton.jit
def _dot_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    K_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_launch_next(PDL)
    acc, rows, n, mask = _dot_slice(x_ptr, w_ptr, M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    if ATOMIC:
        tl.atomic_add(y_ptr + rows[:, None] * N + n[None, :], acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + rows[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows2_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    "CUDA cores, all M rows at once: a [BLOCK_M, BLOCK_K] tile of x times each [BLOCK_N, BLOCK_K] weight tile."
    pdl_launch_next(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
    pdl_wait(PDL)
    x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0)
    acc = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + k
        w = tl.load(
            w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :], other=0.0
        )
        x = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=(rows < M)[:, None] & (kk < K)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(
        y_ptr + rows[:, None] * N + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows < M)[:, None] & (n < N)[None, :],
    )


@triton.jit
def sum_splits(
    y_ptr, part_ptr, count_ptr, acc, offs, mask, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Store this program's float32 partial (K slice program_id(1)); the last of its column block's programs to finish
    (a counter it then resets, so the next launch finds it at zero) sums them all into y."""
    pid_n = tl.program_id(0)
    tl.store(part_ptr + tl.program_id(1) * BLOCK_M * N + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial written before the counter says so
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
    if arrived == SPLITS - 1:
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(part_ptr + s * BLOCK_M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _splitk_kernel(
    y_ptr,
    part_ptr,
    count_ptr,
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    K_SPLIT,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Tensor cores, split-K in one kernel: each program writes its float32 partial product, and the last of a column
    block's programs to finish (a counter it then resets) sums them into y."""
    pdl_launch_next(PDL)
    acc, rows, n, mask = _dot_slice(x_ptr, w_ptr, M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    sum_splits(y_ptr, part_ptr, count_ptr, acc, rows[:, None] * N + n[None, :], mask, N, SPLITS, BLOCK_M, BLOCK_N)


def rows2_mm(x, w, bn=2, bk=512, warps=4, pdl=False):
    return rows_mm(x, w, bn, bk, warps, pdl, kernel=_rows2_kernel)


_SCRATCH: dict = {}


def split_scratch(device, block_m, n, splits, block_n) -> tuple[torch.Tensor, torch.Tensor]:
    "`sum_splits`' float32 partials and zeroed counters, kept per shape (the counters reset themselves)."
    key = (device, block_m, n, splits, block_n)
    if key not in _SCRATCH:
        _SCRATCH[key] = (
            torch.empty(splits * block_m * n, dtype=torch.float32, device=device),
            torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=device),
        )
    return _SCRATCH[key]


def splitk_mm(x, w, bn=32, bk=128, splits=4, stages=3, warps=4, pdl=False):
    "Split-K in one launch; the partials and counters are kept per shape (the counters reset themselves)."
    M, K = x.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M))
    k_split = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, k_split)
    part, count = split_scratch(x.device, bm, N, splits, bn)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _splitk_kernel[(triton.cdiv(N, bn), splits)](
        y,
        part,
        count,
        x,
        w,
        M,
        N,
        K,
        k_split,
        SPLITS=splits,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return y


def rows_mm(x, w, bn=4, bk=1024, warps=4, pdl=False, kernel=_rows_kernel):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(N, bn),)](
        y,
        x,
        w,
        M,
        N,
        K,
        BLOCK_M=triton.next_power_of_2(M),
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return y


def dot_mm(x, w, bn=32, bk=128, split=1, stages=4, warps=4, pdl=False):
    M, K = x.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M))
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    if split > 1:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _dot_kernel[(triton.cdiv(N, bn), triton.cdiv(K, k_split))](
        y,
        x,
        w,
        M,
        N,
        K,
        k_split,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        ATOMIC=split > 1,
        num_warps=warps,
        num_stages=stages,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return y if split == 1 else y.to(x.dtype)


SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


KINDS = ("gemv", "rows", "rows2", "splitk", "dot")


def candidates(x: torch.Tensor, kinds=KINDS, pdls=(False, True)) -> dict:
    "Every kernel and tile choice of `kinds` for the rows `x` (cuBLAS always), as functions of the weight."
    from minivllm.kernels.gemv import gemv

    m = x.shape[0]
    cands = {"cublas": lambda w, x=x: torch.nn.functional.linear(x, w)}
    if m == 1:
        cands["gemv"] = lambda w, x=x: gemv(x, w)
    for pdl in pdls:
        tag = "_pdl" if pdl else ""
        for bn, bk in ((2, 1024), (4, 1024), (4, 512), (8, 512)) if m <= 16 else ():
            cands[f"rows_n{bn}_k{bk}{tag}"] = lambda w, x=x, bn=bn, bk=bk, pdl=pdl: rows_mm(x, w, bn, bk, pdl=pdl)
        for bn, bk in ((1, 1024), (2, 512), (2, 1024), (4, 256), (4, 512)) if m <= 16 else ():
            if m * bn * bk <= 16384:
                cands[f"rows2_n{bn}_k{bk}{tag}"] = lambda w, x=x, bn=bn, bk=bk, pdl=pdl: rows2_mm(x, w, bn, bk, pdl=pdl)
        for bn, bk, sp in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8)):
            name = f"splitk_n{bn}_k{bk}_x{sp}{tag}"
            cands[name] = lambda w, x=x, bn=bn, bk=bk, sp=sp, pdl=pdl: splitk_mm(x, w, bn, bk, sp, pdl=pdl)
        for bn in (16, 32, 64):
            for bk in (128, 256):
                for st in (2, 4):
                    name = f"dot_n{bn}_k{bk}_s{st}{tag}"
                    cands[name] = lambda w, x=x, bn=bn, bk=bk, st=st, pdl=pdl: dot_mm(x, w, bn, bk, 1, st, pdl=pdl)
    return {c: f for c, f in cands.items() if c == "cublas" or c.split("_")[0] in kinds}


def check_on_cpu() -> None:
    "The kernels against x @ W^T in Triton's interpreter: the largest difference for each."
    for m in (1, 3, 5, 8, 16, 20):
        x, w = torch.randn(m, 96), torch.randn(80, 96)
        ref = x @ w.T
        errors = [
            (f(x, w) - ref).abs().max().item()
            for f in (
                lambda x, w: rows_mm(x, w, 4, 32),
                lambda x, w: dot_mm(x, w, 16, 32),
                lambda x, w: dot_mm(x, w, 16, 32, split=2),
                lambda x, w: rows2_mm(x, w, 2, 32),
                lambda x, w: splitk_mm(x, w, 16, 32, 2),
                lambda x, w: splitk_mm(x, w, 32, 16, 4),
            )
        ]
        print(m, errors)
        assert max(errors) < 1e-3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,2,4,8,16,32", help="the row counts M, comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"kernels besides cuBLAS, of {KINDS}")
    ap.add_argument("--no-pdl", action="store_true", help="only kernels launched without early launch")
    args = ap.parse_args()
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        return check_on_cpu()
    from kernel_variants import time_in_graph  # (tools/, the folder python puts first for a script)

    out = {"device": torch.cuda.get_device_name(), "results": {}}
    copies = 24  # more than the L2 cache holds: the weights stream from memory, as a model's layers do
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(copies)]
        bound_us = n * k * 2 / 3.05e12 * 1e6
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ weights[0].float().T
            res = {}
            pdls = (False,) if args.no_pdl else (False, True)
            for cname, fn in candidates(x, args.kinds.split(","), pdls).items():
                try:
                    err = (fn(weights[0]).float() - ref).abs().max().item()
                    res[cname] = (round(time_in_graph(fn, weights), 2), round(err, 4))
                except Exception as e:  # noqa: BLE001 (a tile that does not compile: recorded, not fatal)
                    res[cname] = (None, str(e)[:80])
            ok = {c: v for c, v in res.items() if v[0] is not None and v[1] < 0.05 * ref.abs().max().item() + 0.05}
            best = sorted(ok.items(), key=lambda kv: kv[1][0])[:4]
            print(f"{name} N={n} K={k} M={m}: bound {bound_us:.2f} us, cublas {res['cublas'][0]} us; best {best}")
            out["results"][f"{name}_M{m}"] = {"bound_us": bound_us, "res": res}
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
