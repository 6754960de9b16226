"""A decode step's four products at a few rows (batch 8 or 32), chained over 28 layers: cuBLAS against one kernel each.

    python tools/few_row_chain_probe.py OUT.json                 # on a GPU (Hopper: early launch, bulk L2 prefetch)
    python tools/few_row_chain_probe.py OUT.json --sweep-rows 8,32 --grid wide   # wider tiles, split-K: 8 and 32 rows
    TRITON_INTERPRET=1 python tools/few_row_chain_probe.py x.json --check-only   # on a CPU: the kernel against torch

The engine's step at batch 8 runs each layer's products as cuBLAS kernels with a norm before qkv and gate/up and the
activation after gate/up: seven kernels of 1.3 to 7 us, each waiting for the one before. Here each product is one
Triton kernel (the package's `_few_rows_kernel`, at tiles the sweep chooses): the norm (with the pending residual
add) in its prologue, the activation in its epilogue, and its weights asked for before it waits for the kernel ahead
(early launch, PDL): the first tile into registers, and with prefetch mode 2 the whole row into L2 too. Chains timed
as CUDA graphs (median of replays), weights of 28 layers (840 MB, more than L2 holds). The question: does the chain
of fused kernels launched early take less time a layer than the engine's, by the ~10 us a layer that batch 8's 2x
target needs?
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from few_row_bench import _SCRATCH, split_scratch, sum_splits  # noqa: F401 (_SCRATCH: the partials kept per shape)

from minivllm.kernels.common import pdl_launch_next, pdl_wait
from minivllm.kernels.few_rows import _few_rows_kernel, _input_tile, _weight_tile

LAYERS, HIDDEN, Q, KV, INTER = 28, 1024, 2048, 1024, 3072
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _splitk_kernel(
    y_ptr, part_ptr, count_ptr, x_ptr, w_ptr, M, N, K, K_SPLIT, stride_x,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH_L2: tl.constexpr, PDL: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """The package's few-row product over one slice of K a program (program_id(1)): each writes its float32 partial,
    and the last of a column block's programs to finish (a counter it then resets) sums them into y."""
    pdl_launch_next(PDL)
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * K_SPLIT + tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    if PREFETCH_L2:  # this program's slice of each weight row on its way to L2
        ptrs = w_ptr + tl.where(n < N, n, 0).to(tl.int64) * K + tl.program_id(1) * K_SPLIT
        nbytes = tl.full(n.shape, 0, tl.int32) + tl.minimum(K_SPLIT, K - tl.program_id(1) * K_SPLIT) * 2
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r", [ptrs, nbytes],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    w = _weight_tile(w_ptr, n, k, N, K)
    pdl_wait(PDL)
    h = _input_tile(x_ptr, rows, k, M, K, stride_x)
    if DOT_FP32:
        h, w = h.to(tl.float32), w.to(tl.float32)
    acc = tl.dot(h, w)
    for k0 in range(BLOCK_K, K_SPLIT, BLOCK_K):
        w = _weight_tile(w_ptr, n, k0 + k, N, K)
        h = _input_tile(x_ptr, rows, k0 + k, M, K, stride_x)
        if DOT_FP32:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, w, acc)
    mask = (rows < M)[:, None] & (n < N)[None, :]
    sum_splits(y_ptr, part_ptr, count_ptr, acc, rows[:, None] * N + n[None, :], mask, N, SPLITS, BLOCK_M, BLOCK_N)


def splitk(x, w, cfg, pdl=False, out=None):
    "x [M, K] @ w.T in `cfg[5]` slices of K (cfg as `few_rows`'), one launch; partials and counters kept per shape."
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, warps, stages, prefetch, splits = cfg
    block_m = max(16, triton.next_power_of_2(m))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)
    part, count = split_scratch(x.device, block_m, n, splits, block_n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    extra = {} if INTERPRET else {"launch_pdl": pdl}
    _splitk_kernel[(triton.cdiv(n, block_n), splits)](
        y, part, count, x, w, m, n, k, k_split, x.stride(0),
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH_L2=prefetch == 2 and not INTERPRET, PDL=pdl and not INTERPRET, DOT_FP32=INTERPRET,
        num_warps=warps, num_stages=stages, **extra,
    )  # fmt: skip
    return y


def few_rows(x, w, cfg, norm=None, silu=False, pdl=False):
    """x [M, K] (rows may be strided) @ w.T; norm = (residual, norm_weight, eps): returns (y, x + residual).
    cfg: (block_n, block_k, warps, stages, prefetch mode[, K slices]); more than one slice: `splitk` (no norm)."""
    if len(cfg) > 5 and cfg[5] > 1:
        assert norm is None and not silu
        return splitk(x, w, cfg, pdl)
    m, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    block_n, block_k, warps, stages, prefetch = cfg[:5]
    block_k = k if norm is not None else min(block_k, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    total = torch.empty(m, k, dtype=x.dtype, device=x.device) if norm is not None else y
    res, nw, eps = norm if norm is not None else (x, x, 0.0)
    extra = {} if INTERPRET else {"launch_pdl": pdl}
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        y, total, x, res, nw, w, m, n, k, x.stride(0), eps,
        NORM=norm is not None, HAS_RESIDUAL=norm is not None, FUSE_SILU=silu,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH_L2=prefetch == 2 and not INTERPRET, PDL=pdl and not INTERPRET, DOT_FP32=INTERPRET,
        DOT_PRECISION="tf32", num_warps=warps, num_stages=stages, **extra,
    )  # fmt: skip
    return (y, total) if norm is not None else y


def ref_norm(x, res, nw, eps):
    h = (x.float() + res.float()).to(x.dtype)
    hf = h.float()
    return nw * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), h


def make_layers(device, layers=LAYERS):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16).to(device)

    return [
        dict(
            qkv=rnd(Q + 2 * KV, HIDDEN),
            o=rnd(HIDDEN, Q),
            gate_up=rnd(2 * INTER, HIDDEN),
            down=rnd(HIDDEN, INTER),
            n1=1 + rnd(HIDDEN, std=0.1),
            n2=1 + rnd(HIDDEN, std=0.1),
        )
        for _ in range(layers)
    ]


def engine_layer(x, res, p, silu_mul, add_rms_norm):
    h, res = add_rms_norm(x, res, p["n1"], 1e-6)
    qkv = F.linear(h, p["qkv"])
    o = F.linear(qkv[:, :Q], p["o"])
    h, res = add_rms_norm(o, res, p["n2"], 1e-6)
    return F.linear(silu_mul(F.linear(h, p["gate_up"])), p["down"]), res


def fused_layer(x, res, p, cfgs, pdl):
    qkv, res = few_rows(x, p["qkv"], cfgs["qkv"], (res, p["n1"], 1e-6), pdl=pdl)
    o = few_rows(qkv[:, :Q], p["o"], cfgs["o"], pdl=pdl)
    act, res = few_rows(o, p["gate_up"], cfgs["gate_up"], (res, p["n2"], 1e-6), silu=True, pdl=pdl)
    return few_rows(act, p["down"], cfgs["down"], pdl=pdl), res


def check(device, m, cfgs) -> dict:
    "One layer's products against torch: the largest difference over the largest value, per product."
    p = make_layers(device, 1)[0]
    x = torch.randn(m, HIDDEN, device=device).to(torch.bfloat16)
    res = torch.randn(m, HIDDEN, device=device).to(torch.bfloat16)
    out = {}
    h, total = ref_norm(x, res, p["n1"], 1e-6)
    qkv, got_total = few_rows(x, p["qkv"], cfgs["qkv"], (res, p["n1"], 1e-6))
    out["qkv"] = rel(qkv, h.float() @ p["qkv"].float().T)
    out["sum"] = rel(got_total, total.float())
    o = few_rows(qkv[:, :Q], p["o"], cfgs["o"])
    out["o"] = rel(o, qkv[:, :Q].float() @ p["o"].float().T)
    act, _ = few_rows(h, p["gate_up"], cfgs["gate_up"], (torch.zeros_like(h), p["n2"], 1e-6), silu=True)
    h2, _ = ref_norm(h, torch.zeros_like(h), p["n2"], 1e-6)
    gu = h2.float() @ p["gate_up"].float().T
    out["gate_up"] = rel(act, F.silu(gu[:, :INTER]) * gu[:, INTER:])
    down = few_rows(act, p["down"], cfgs["down"])
    out["down"] = rel(down, act.float() @ p["down"].float().T)
    return out


def rel(got, want) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def bench(fn, rep=300) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


PRODUCTS = {"qkv": (True, False), "o": (False, False), "gate_up": (True, True), "down": (False, False)}


def sweep_product(name, layers, m, configs, pdl) -> list[dict]:
    "28 of one product in a chain (each layer's weight), every configuration: us a product."
    norm, silu = PRODUCTS[name]
    x0 = torch.randn(m, layers[0][name].shape[1], device="cuda").to(torch.bfloat16)
    res = torch.zeros(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    out = []
    for cfg in configs:

        def chain(cfg=cfg):
            x = x0
            for p in layers:
                nrm = (res, p["n1"], 1e-6) if norm else None
                y = few_rows(x, p[name], cfg, nrm, silu=silu, pdl=pdl)
                y = y[0] if norm else y
                x = y[:, : x0.shape[1]] if y.shape[1] >= x0.shape[1] else x0

        try:
            out.append({"cfg": cfg, "us": bench(chain, rep=100) / len(layers)})
        except Exception as e:  # a configuration that does not fit (shared memory, registers)
            out.append({"cfg": cfg, "error": str(e)[:200]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--sweep-rows", default="8", help="sweep the launch choices at these row counts only (8,32)")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--grid", choices=("narrow", "wide"), default="narrow", help="wide: 8 warps and 64-wide tiles too")
    args = ap.parse_args()
    sweep_rows = [int(r) for r in args.sweep_rows.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = {
        "qkv": (16, 1024, 4, 1, 1),
        "o": (16, 1024, 4, 2, 2),
        "gate_up": (16, 1024, 8, 1, 1),
        "down": (16, 512, 4, 3, 2),
    }
    result = {"rows": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        split = dict(default, o=(16, 256, 4, 2, 2, 2), down=(32, 256, 4, 2, 1, 4))
        result["rows"][m] = {"check": check(device, m, default), "check_split": check(device, m, split)}
        print(m, "check", result["rows"][m]["check"], result["rows"][m]["check_split"], flush=True)
    if args.check_only or device == "cpu":
        json.dump(result, open(args.out, "w"), indent=1)
        return
    from minivllm.kernels.activation import silu_mul
    from minivllm.layers.layernorm import add_rms_norm

    result["environment"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    layers = make_layers("cuda")
    for m in [int(r) for r in args.rows.split(",")]:
        r = result["rows"][m]
        best = {}
        for name in PRODUCTS:
            k = layers[0][name].shape[1]
            if m not in sweep_rows:
                continue
            if k > HIDDEN and args.grid == "wide":  # (split-K last: a tie keeps one launch)
                grid = itertools.chain(
                    itertools.product((16, 32, 64), (256, 512), (4, 8), (3,), (1, 2)),
                    itertools.product((16, 32, 64), (256,), (4,), (2, 3), (2,), (2, 4)),
                )
            elif k > HIDDEN:
                grid = itertools.product((16, 32), (256, 512, 1024), (4,), (2, 3), (1, 2))
            else:
                grid = itertools.product((16, 32), (1024,), (4, 8), (1,), (1, 2))
            swept = sweep_product(name, layers, m, list(grid), pdl=True)
            ok = [s for s in swept if "us" in s]
            best[name] = min(ok, key=lambda s: s["us"])["cfg"]
            r[f"sweep_{name}"] = swept
            print(m, name, "best", best[name], f"{min(s['us'] for s in ok):.2f} us", flush=True)
            json.dump(result, open(args.out, "w"), indent=1, default=str)  # what a cut-short run measured
        best = best or result["rows"][sweep_rows[0]]["best"]
        r["best"] = best
        r["check_best"] = check("cuda", m, best)
        x0 = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
        res0 = torch.zeros_like(x0)

        def run(kind, pdl=False, x0=x0, res0=res0, best=best):
            x, res = x0, res0
            for p in layers:
                if kind == "engine":
                    x, res = engine_layer(x, res, p, silu_mul, add_rms_norm)
                else:
                    x, res = fused_layer(x, res, p, best, pdl)
            return x

        run("engine")  # compile the norms first
        for _round in range(3):
            for kind, pdl in (("engine", False), ("fused", False), ("fused", True)):
                key = f"{kind}{'_pdl' if pdl else ''}"
                us = bench(functools.partial(run, kind, pdl)) / LAYERS
                r.setdefault(key, []).append(us)
        for key in ("engine", "fused", "fused_pdl"):
            r[key + "_median"] = sorted(r[key])[1]
        print(m, {k: round(r[k + "_median"], 2) for k in ("engine", "fused", "fused_pdl")}, "us a layer", flush=True)
        json.dump(result, open(args.out, "w"), indent=1, default=str)
    json.dump(result, open(args.out, "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
