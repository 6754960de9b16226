"""A small batch's decode step as one persistent kernel over all layers: fewer waits than the engine's kernel chain?

    python tools/persistent_decode_probe.py OUT.json [--batches 8 32] [--configs ...]      # on a GPU
    TRITON_INTERPRET=1 python tools/persistent_decode_probe.py x.json                      # on a CPU, tiny shapes
    python tools/persistent_decode_probe.py x.json --compile-only    # sm_90 registers, stack, shared memory (CPU)

Why: at batch 8 a decode step of Qwen3-0.6B's shapes runs about 11 kernels a layer (312 a step), each waiting for
the one before; the products take 5 to 8 us whatever their weight's size (docs/speed.md), and fusing or retiling them
measured no faster. Here one program per SM runs every layer: the qkv product with the norm in front, attention (the
q/k norms and rotation and the new token's K/V write inside, splits merged by the last one to finish), the o product
with the residual add, gate/up with the norm and activation, down with the residual add. Five grid-wide barriers a
layer replace the kernel boundaries; a barrier's counter is polled with `ld.acquire.gpu` loads (atomic reads queue
at one L2 address). So that a wait overlaps the next stage's weight reads, a configuration may ask L2 for the next
tile's weights before each barrier (`prefetch`, Hopper's bulk prefetch: measured slower) or load the whole tile into
registers (`preload`, not yet measured; its sm_90 build spills a few hundred bytes a thread).

    --configs 2:64:8:2:0            # splits:block_n:warps:stages:prefetch, the default
    --configs 2:64:8:2:0:0          # :parts: 0 runs the barriers alone (bits: qkv, attention, o, gate/up, down)
    --configs 2:64:8:2:0:31:3:1     # :k_stages:preload: the products' pipeline depth, weights held across barriers

Every buffer a stage writes is written once a step (one slot per layer), so no SM can read a stale L1 line; the
barrier counter and the merge counters are zeroed at the step's start. A barrier gives up after `MAX_POLLS` polls and
raises a flag the host checks: a wrong launch fails instead of hanging.

Timed as a CUDA graph (median of replays, `triton.testing.do_bench_cudagraph`) with the final norm and lm_head
product, against the same math as a chain of torch kernels, on random weights of Qwen3-0.6B's shapes; checked against
a torch reference of the same rounding. The engine's own step is timed by `python -m minivllm.bench --latency` in the
same call.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels.few_rows import _prefetch_rows
from minivllm.kernels.merge_splits import _fold_parts
from minivllm.kernels.paged_decode_kernel import _decode_tiles, _split_tiles
from minivllm.kernels.qk_norm_rope import _norm_rotate

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_POLLS = tl.constexpr(1 << 20)  # a barrier's polls before it gives up (under a second on an H100)
EPS = 1e-6


@triton.jit
def _now():
    "The GPU's global nanosecond clock."
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _poll(bar_ptr, ACQUIRE_LOADS: tl.constexpr):
    """The barrier's count, read with acquire order: a plain load (`ld.acquire.gpu`) on a GPU, which many programs
    can poll at once; an atomic read-modify-write (which serializes at the L2 cache) in the interpreter."""
    if ACQUIRE_LOADS:
        seen = tl.inline_asm_elementwise(
            "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [bar_ptr + tl.zeros([1], tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
        return tl.max(seen, 0)
    return tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _grid_sync(bar_ptr, err_ptr, target, times_ptr, TIMELINE: tl.constexpr, ACQUIRE_LOADS: tl.constexpr):
    """Wait until `target` arrivals: every program's stores before it are visible to every program after it.
    TIMELINE: the program's clock at arrival and at leaving, at times_ptr[0] and [1]."""
    tl.debug_barrier()
    if TIMELINE:
        tl.store(times_ptr, _now())
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = _poll(bar_ptr, ACQUIRE_LOADS)
    polls = tl.where(tl.load(err_ptr, volatile=True) != 0, MAX_POLLS, 0)  # an earlier barrier gave up: so do we
    while (seen < target) & (polls < MAX_POLLS):
        seen = _poll(bar_ptr, ACQUIRE_LOADS)
        polls += 1
    if polls >= MAX_POLLS:
        tl.atomic_xchg(err_ptr, 1)
    tl.debug_barrier()
    if TIMELINE:
        tl.store(times_ptr + 1, _now())


@triton.jit
def _prefetch(w_ptr, n, N, K, ON: tl.constexpr):
    "Ask L2 for weight rows n (the few-row products' bulk prefetch; rows past N: row 0 again)."
    if ON:
        _prefetch_rows(w_ptr, n, N, K)


@triton.jit
def _rows_rstd(x_ptr, rows, B, K: tl.constexpr, eps):
    "1 / rms of x's rows [BM] (float32)."
    k = tl.arange(0, K)
    x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows < B)[:, None], other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)


@triton.jit
def _rows_product(x_ptr, rows, B, w_ptr, n, K: tl.constexpr, KC: tl.constexpr, rstd, nw_ptr, NORM: tl.constexpr,
                  DOT_FP32: tl.constexpr, K_STAGES: tl.constexpr):  # fmt: skip
    """x[rows] @ w[n].T in float32 over chunks of KC inputs; NORM: x is rms_norm(x) * nw first, rounded as the engine
    rounds (`rstd` from `_rows_rstd`)."""
    acc = tl.zeros([rows.shape[0], n.shape[0]], tl.float32)
    for c in tl.range(0, K // KC, num_stages=K_STAGES):
        k = c * KC + tl.arange(0, KC)
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows < B)[:, None], other=0.0)
        if NORM:
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
            x = (normed.to(tl.float32) * tl.load(nw_ptr + k).to(tl.float32)[None, :]).to(x.dtype)
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * K + k[:, None])
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _weight_tile(w_ptr, n, N, K: tl.constexpr, k0: tl.constexpr, KW: tl.constexpr):
    "Weight rows n (< N) over inputs [k0, k0 + KW), as the [KW, BN] right-hand side of a product."
    k = k0 + tl.arange(0, KW)
    return tl.load(w_ptr + n[None, :].to(tl.int64) * K + k[:, None], mask=(n < N)[None, :], other=0.0)


@triton.jit
def _tile_product(x_ptr, rows, B, w, K: tl.constexpr, k0: tl.constexpr, rstd, nw_ptr, NORM: tl.constexpr,
                  DOT_FP32: tl.constexpr):  # fmt: skip
    "x[rows, k0:k0 + KW] @ w (a weight tile already in registers, [KW, BN]) in float32; NORM: as `_rows_product`."
    k = k0 + tl.arange(0, w.shape[0])
    x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows < B)[:, None], other=0.0)
    if NORM:
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (normed.to(tl.float32) * tl.load(nw_ptr + k).to(tl.float32)[None, :]).to(x.dtype)
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(x, w)


@triton.jit
def _persistent_decode_kernel(
    h_ptr,  # [2L + 1, B, H]: the residual stream, one slot per write
    qkv_ptr,  # [L, B, QKV]
    qs_ptr,  # [L, items, GP, D]: queries after norm and rotation
    attn_ptr,  # [L, B, QH * D]
    act_ptr,  # [L, B, INTER]
    part_out_ptr,  # [L, B * QH * S, D] float32
    part_lse_ptr,  # [L, B * QH * S] float32
    count_ptr,  # [1 + L * B * KVH] int32, zeroed: the barrier, then the merge counters
    err_ptr,
    times_ptr,  # [P, 5 L + 1, 2] int64 (TIMELINE): each barrier's arrival and leaving; the start and end last
    w_qkv_ptr,
    w_o_ptr,
    w_gu_ptr,
    w_down_ptr,
    ln1_ptr,
    ln2_ptr,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    k_cache_ptr,  # [L, blocks, PAGE, KVH, D]
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    B,
    stride_bt,
    stride_cache_layer,
    qk_scale,
    eps,
    L: tl.constexpr,
    H: tl.constexpr,
    QH: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    INTER: tl.constexpr,
    KC: tl.constexpr,
    PAGE: tl.constexpr,
    BM: tl.constexpr,
    GP: tl.constexpr,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BN_QKV: tl.constexpr,
    BN_O: tl.constexpr,
    BN_GU: tl.constexpr,
    BN_DOWN: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PARTS: tl.constexpr = 31,
    TIMELINE: tl.constexpr = False,
    ACQUIRE_LOADS: tl.constexpr = True,
    K_STAGES: tl.constexpr = 3,
    PRELOAD: tl.constexpr = False,
    DOWN_KA: tl.constexpr = 0,
    DOWN_KB: tl.constexpr = 0,
):
    pid, P = tl.program_id(0), tl.num_programs(0)
    QKV: tl.constexpr = (QH + 2 * KVH) * D
    GROUP: tl.constexpr = QH // KVH
    rows = tl.arange(0, BM)
    row_ok = rows < B
    bar = count_ptr
    syncs = 0
    items = B * KVH * S
    if TIMELINE:
        tl.store(times_ptr + (pid * (5 * L + 1) + 5 * L) * 2, _now())
    for layer in tl.range(0, L, num_stages=1):
        if PRELOAD:  # each program's first weight tile of a stage goes to registers before the barrier ahead of it
            w_q = _weight_tile(w_qkv_ptr + layer * QKV * H, pid * BN_QKV + tl.arange(0, BN_QKV), QKV, H, 0, H)
        if layer > 0:  # the previous layer's down stage
            syncs += 1
            _grid_sync(
                bar, err_ptr, syncs * P, times_ptr + (pid * (5 * L + 1) + syncs - 1) * 2, TIMELINE, ACQUIRE_LOADS
            )
        # qkv = rms_norm(h) @ w_qkv.T
        for t in tl.range(pid, QKV // BN_QKV if PARTS & 1 else 0, P, num_stages=1):
            n_qkv = t * BN_QKV + tl.arange(0, BN_QKV)
            h_in = h_ptr + (2 * layer) * B * H
            rstd = _rows_rstd(h_in, rows, B, H, eps)
            if PRELOAD:
                w = w_q
                if t != pid:
                    w = _weight_tile(w_qkv_ptr + layer * QKV * H, n_qkv, QKV, H, 0, H)
                y = _tile_product(h_in, rows, B, w, H, 0, rstd, ln1_ptr + layer * H, True, DOT_FP32)
            else:
                w_l = w_qkv_ptr + layer * QKV * H
                y = _rows_product(h_in, rows, B, w_l, n_qkv, H, KC, rstd, ln1_ptr + layer * H, True, DOT_FP32, K_STAGES)
            out = qkv_ptr + (layer * B + rows[:, None]) * QKV + n_qkv[None, :]
            tl.store(out, y.to(qkv_ptr.dtype.element_ty), mask=row_ok[:, None])
        syncs += 1
        _grid_sync(bar, err_ptr, syncs * P, times_ptr + (pid * (5 * L + 1) + syncs - 1) * 2, TIMELINE, ACQUIRE_LOADS)
        # attention: program `item` holds (sequence, KV head, split)
        nxt_o = pid * BN_O + tl.arange(0, BN_O)
        _prefetch(w_o_ptr + layer * H * QH * D, nxt_o, H, QH * D, PREFETCH)
        for item in tl.range(pid, items if PARTS & 2 else 0, P, num_stages=1):
            seq, kvh, split = item // (KVH * S), (item // S) % KVH, item % S
            ctx = tl.load(context_lens_ptr + seq)
            pos = ctx - 1
            half = tl.arange(0, D // 2)[None, :]
            angles = cos_sin_ptr + pos.to(tl.int64) * D
            cos, sin = tl.load(angles + half), tl.load(angles + D // 2 + half)
            row_qkv = qkv_ptr + (layer * B + seq) * QKV
            g = tl.arange(0, GP)[:, None]
            heads = kvh * GROUP + g
            qmask = (g < GROUP) & (half >= 0)
            x1 = tl.load(row_qkv + heads * D + half, mask=qmask, other=0.0)
            x2 = tl.load(row_qkv + heads * D + D // 2 + half, mask=qmask, other=0.0)
            y1, y2 = _norm_rotate(x1, x2, qn_ptr + layer * D, cos, sin, eps, D, True)
            qs = qs_ptr + ((layer * items + item) * GP + g) * D + half
            tl.store(qs, y1.to(qs_ptr.dtype.element_ty))
            tl.store(qs + D // 2, y2.to(qs_ptr.dtype.element_ty))
            table = block_tables_ptr + seq * stride_bt
            k_layer = k_cache_ptr + layer * stride_cache_layer
            v_layer = v_cache_ptr + layer * stride_cache_layer
            if split == S - 1:  # the new token's K and V, written by the split that reads its position
                slot = tl.load(table + pos // PAGE).to(tl.int64) * PAGE + pos % PAGE
                kx = row_qkv + (QH + kvh) * D + half
                k1, k2 = _norm_rotate(tl.load(kx), tl.load(kx + D // 2), kn_ptr + layer * D, cos, sin, eps, D, True)
                kc = k_layer + (slot * KVH + kvh) * D + half
                tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty))
                tl.store(kc + D // 2, k2.to(k_cache_ptr.dtype.element_ty))
                d = tl.arange(0, D)
                v = tl.load(row_qkv + (QH + KVH + kvh) * D + d)
                tl.store(v_layer + (slot * KVH + kvh) * D + d, v)
            tl.debug_barrier()
            dims = tl.arange(0, D)
            q = tl.load(qs_ptr + ((layer * items + item) * GP + g) * D + dims[None, :])
            if DOT_FP32:
                q = q.to(tl.float32)
            kv = (k_layer, v_layer, (PAGE * KVH * D, KVH * D, D), (PAGE * KVH * D, KVH * D, D), kvh, dims, dims < D)
            tiles = _split_tiles(0, ctx, split, S, BLOCK_N)
            m_i, l_i, acc = _decode_tiles(
                q, qk_scale, kv, (table, 0, ctx), tiles, PAGE, BLOCK_N, False, False, "ieee" if DOT_FP32 else "tf32"
            )
            hrow = tl.arange(0, GP)
            hmask = hrow < GROUP
            attn = attn_ptr + (layer * B + seq) * QH * D + (kvh * GROUP + hrow)[:, None] * D + dims[None, :]
            if S == 1:
                l_i = tl.where(l_i > 0, l_i, 1.0)
                tl.store(attn, (acc / l_i[:, None]).to(attn_ptr.dtype.element_ty), mask=hmask[:, None])
            else:
                l_i = tl.where(l_i > 0, l_i, 1.0)
                first = (seq * QH + kvh * GROUP + hrow) * S  # each head's first split slot
                parts_o = part_out_ptr + layer * B * QH * S * D
                parts_l = part_lse_ptr + layer * B * QH * S
                tl.store(
                    parts_o + (first + split)[:, None] * D + dims[None, :], acc / l_i[:, None], mask=hmask[:, None]
                )
                tl.store(parts_l + first + split, m_i + tl.log2(l_i), mask=hmask)
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + 1 + (layer * B + seq) * KVH + kvh, 1, sem="acq_rel", scope="gpu")
                if done == S - 1:  # the last split of this head group: merge all
                    m0 = tl.full([GP], float("-inf"), tl.float32)
                    l0 = tl.zeros([GP], tl.float32)
                    a0 = tl.zeros([GP, D], tl.float32)
                    m0, l0, a0 = _fold_parts(m0, l0, a0, parts_o, parts_l, first, S, dims, hmask, D, "")
                    l0 = tl.where(l0 > 0, l0, 1.0)
                    tl.store(attn, (a0 / l0[:, None]).to(attn_ptr.dtype.element_ty), mask=hmask[:, None])
        if PRELOAD:
            w_o = _weight_tile(w_o_ptr + layer * H * QH * D, pid * BN_O + tl.arange(0, BN_O), H, QH * D, 0, QH * D)
        syncs += 1
        _grid_sync(bar, err_ptr, syncs * P, times_ptr + (pid * (5 * L + 1) + syncs - 1) * 2, TIMELINE, ACQUIRE_LOADS)
        # h' = h + attn @ w_o.T, a tile of columns each
        for t in tl.range(pid, H // BN_O if PARTS & 4 else 0, P, num_stages=1):
            n_o = t * BN_O + tl.arange(0, BN_O)
            x_in = attn_ptr + layer * B * QH * D
            w_l = w_o_ptr + layer * H * QH * D
            if PRELOAD:
                w = w_o
                if t != pid:
                    w = _weight_tile(w_l, n_o, H, QH * D, 0, QH * D)
                o = _tile_product(x_in, rows, B, w, QH * D, 0, rows, x_in, False, DOT_FP32)
            else:
                o = _rows_product(x_in, rows, B, w_l, n_o, QH * D, KC, rows, x_in, False, DOT_FP32, K_STAGES)
            o = o.to(h_ptr.dtype.element_ty)
            cols = rows[:, None] * H + n_o[None, :]
            res = tl.load(h_ptr + (2 * layer) * B * H + cols, mask=row_ok[:, None], other=0.0)
            total = (o.to(tl.float32) + res.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + (2 * layer + 1) * B * H + cols, total, mask=row_ok[:, None])
        nxt_gu = pid * BN_GU + tl.arange(0, BN_GU)
        _prefetch(w_gu_ptr + layer * 2 * INTER * H, nxt_gu, INTER, H, PREFETCH)
        _prefetch(w_gu_ptr + (layer * 2 * INTER + INTER) * H, nxt_gu, INTER, H, PREFETCH)
        if PRELOAD:
            w_g = _weight_tile(w_gu_ptr + layer * 2 * INTER * H, nxt_gu, INTER, H, 0, H)
            w_u = _weight_tile(w_gu_ptr + (layer * 2 * INTER + INTER) * H, nxt_gu, INTER, H, 0, H)
        syncs += 1
        _grid_sync(bar, err_ptr, syncs * P, times_ptr + (pid * (5 * L + 1) + syncs - 1) * 2, TIMELINE, ACQUIRE_LOADS)
        # act = silu(x @ gate.T) * (x @ up.T), x = rms_norm(h')
        for t in tl.range(pid, INTER // BN_GU if PARTS & 8 else 0, P, num_stages=1):
            n_gu = t * BN_GU + tl.arange(0, BN_GU)
            h_in = h_ptr + (2 * layer + 1) * B * H
            rstd = _rows_rstd(h_in, rows, B, H, eps)
            w_gate = w_gu_ptr + layer * 2 * INTER * H
            nw = ln2_ptr + layer * H
            if PRELOAD:
                wg, wu = w_g, w_u
                if t != pid:
                    wg = _weight_tile(w_gate, n_gu, INTER, H, 0, H)
                    wu = _weight_tile(w_gate + INTER * H, n_gu, INTER, H, 0, H)
                gate = _tile_product(h_in, rows, B, wg, H, 0, rstd, nw, True, DOT_FP32)
                up = _tile_product(h_in, rows, B, wu, H, 0, rstd, nw, True, DOT_FP32)
            else:
                gate = _rows_product(h_in, rows, B, w_gate, n_gu, H, KC, rstd, nw, True, DOT_FP32, K_STAGES)
                up = _rows_product(h_in, rows, B, w_gate + INTER * H, n_gu, H, KC, rstd, nw, True, DOT_FP32, K_STAGES)
            gate = gate.to(act_ptr.dtype.element_ty).to(tl.float32)  # the engine rounds the product, then SiLU
            up = up.to(act_ptr.dtype.element_ty).to(tl.float32)
            act = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(
                act_ptr + (layer * B + rows[:, None]) * INTER + n_gu[None, :],
                act.to(act_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
        nxt_dn = pid * BN_DOWN + tl.arange(0, BN_DOWN)
        _prefetch(w_down_ptr + layer * H * INTER, nxt_dn, H, INTER, PREFETCH)
        if PRELOAD:  # INTER = DOWN_KA + DOWN_KB, each a power of two (3,072 = 2,048 + 1,024)
            w_da = _weight_tile(w_down_ptr + layer * H * INTER, nxt_dn, H, INTER, 0, DOWN_KA)
            if DOWN_KB > 0:
                w_db = _weight_tile(w_down_ptr + layer * H * INTER, nxt_dn, H, INTER, DOWN_KA, DOWN_KB)
        syncs += 1
        _grid_sync(bar, err_ptr, syncs * P, times_ptr + (pid * (5 * L + 1) + syncs - 1) * 2, TIMELINE, ACQUIRE_LOADS)
        # h'' = h' + act @ w_down.T
        for t in tl.range(pid, H // BN_DOWN if PARTS & 16 else 0, P, num_stages=1):
            n_dn = t * BN_DOWN + tl.arange(0, BN_DOWN)
            x_in = act_ptr + layer * B * INTER
            w_l = w_down_ptr + layer * H * INTER
            if PRELOAD:
                wa = w_da
                if t != pid:
                    wa = _weight_tile(w_l, n_dn, H, INTER, 0, DOWN_KA)
                acc = _tile_product(x_in, rows, B, wa, INTER, 0, rows, x_in, False, DOT_FP32)
                if DOWN_KB > 0:
                    wb = w_db
                    if t != pid:
                        wb = _weight_tile(w_l, n_dn, H, INTER, DOWN_KA, DOWN_KB)
                    acc += _tile_product(x_in, rows, B, wb, INTER, DOWN_KA, rows, x_in, False, DOT_FP32)
            else:
                acc = _rows_product(x_in, rows, B, w_l, n_dn, INTER, KC, rows, x_in, False, DOT_FP32, K_STAGES)
            cols = rows[:, None] * H + n_dn[None, :]
            res = tl.load(h_ptr + (2 * layer + 1) * B * H + cols, mask=row_ok[:, None], other=0.0)
            down = acc.to(h_ptr.dtype.element_ty)
            total = (down.to(tl.float32) + res.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + (2 * layer + 2) * B * H + cols, total, mask=row_ok[:, None])
        if layer + 1 < L:
            nxt_qkv = pid * BN_QKV + tl.arange(0, BN_QKV)
            _prefetch(w_qkv_ptr + (layer + 1) * QKV * H, nxt_qkv, QKV, H, PREFETCH)
    if TIMELINE:
        tl.store(times_ptr + (pid * (5 * L + 1) + 5 * L) * 2 + 1, _now())


QWEN3_06B = dict(L=28, H=1024, QH=16, KVH=8, D=128, INTER=3072, V=151936)
TINY = dict(L=2, H=64, QH=4, KVH=2, D=32, INTER=192, V=256)


def make_model(shape: dict, device, dtype, seed: int = 0) -> dict:
    "Random weights of `shape`, stacked by layer as the kernel reads them."
    g = torch.Generator(device="cpu").manual_seed(seed)
    L, H, QH, KVH, D, INTER = (shape[k] for k in ("L", "H", "QH", "KVH", "D", "INTER"))

    def rnd(*size, std=0.02, mean=0.0):
        return (mean + torch.randn(*size, generator=g) * std).to(dtype).to(device)

    qkv = (QH + 2 * KVH) * D
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(8192, dtype=torch.float32), inv)
    return dict(
        w_qkv=rnd(L, qkv, H, std=H**-0.5),
        w_o=rnd(L, H, QH * D, std=(QH * D) ** -0.5),
        w_gu=rnd(L, 2 * INTER, H, std=H**-0.5),
        w_down=rnd(L, H, INTER, std=INTER**-0.5),
        ln1=rnd(L, H, std=0.1, mean=1.0),
        ln2=rnd(L, H, std=0.1, mean=1.0),
        qn=rnd(L, D, std=0.1, mean=1.0),
        kn=rnd(L, D, std=0.1, mean=1.0),
        norm=rnd(H, std=0.1, mean=1.0),
        lm_head=rnd(shape["V"], H, std=H**-0.5),
        cos_sin=torch.cat([freqs.cos(), freqs.sin()], -1).to(device),
    )


def make_batch(shape: dict, batch: int, context: int, page: int, device, dtype, seed: int = 1) -> dict:
    "`batch` sequences of `context` tokens (the last one new), their pages scattered over a paged cache a layer."
    g = torch.Generator(device="cpu").manual_seed(seed)
    L, H, KVH, D = (shape[k] for k in ("L", "H", "KVH", "D"))
    per_seq = -(-context // page)
    blocks = batch * per_seq
    tables = torch.randperm(blocks, generator=g).view(batch, per_seq).to(torch.int32)
    cache = lambda: (torch.randn(L, blocks, page, KVH, D, generator=g)).to(dtype).to(device)  # noqa: E731
    return dict(
        h=(torch.randn(batch, H, generator=g)).to(dtype).to(device),
        k_cache=cache(),
        v_cache=cache(),
        tables=tables.to(device),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
    )


def rms(x, w):
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype).float()).to(x.dtype)


def rotate(x, w, cos, sin):
    "Per head: RMSNorm, then the neox rotation, as `_norm_rotate` rounds."
    x = rms(x, w).float()
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference(shape: dict, model: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "The step in torch, float32 math rounded where the kernel rounds: (h out, K cache, V cache)."
    L, H, QH, KVH, D, INTER = (shape[k] for k in ("L", "H", "QH", "KVH", "D", "INTER"))
    h = batch["h"].clone()
    kc, vc = batch["k_cache"].clone(), batch["v_cache"].clone()
    dt = h.dtype
    page = kc.shape[2]
    B = h.shape[0]
    for layer in range(L):
        qkv = (rms(h, model["ln1"][layer]).float() @ model["w_qkv"][layer].float().T).to(dt)
        attn = torch.empty(B, QH * D, dtype=dt, device=h.device)
        for s in range(B):
            ctx = int(batch["context_lens"][s])
            pos = ctx - 1
            cos, sin = model["cos_sin"][pos].chunk(2, -1)
            q = rotate(qkv[s, : QH * D].view(QH, D), model["qn"][layer], cos, sin).to(dt)
            k = rotate(qkv[s, QH * D : (QH + KVH) * D].view(KVH, D), model["kn"][layer], cos, sin).to(dt)
            v = qkv[s, (QH + KVH) * D :].view(KVH, D)
            blk = batch["tables"][s].long()
            kc[layer, blk[pos // page], pos % page] = k
            vc[layer, blk[pos // page], pos % page] = v
            keys = kc[layer, blk].reshape(-1, KVH, D)[:ctx].float()
            vals = vc[layer, blk].reshape(-1, KVH, D)[:ctx].float()
            keys = keys.repeat_interleave(QH // KVH, 1)
            vals = vals.repeat_interleave(QH // KVH, 1)
            p = torch.softmax(torch.einsum("hd,thd->ht", q.float(), keys) / math.sqrt(D), -1)
            attn[s] = torch.einsum("ht,thd->hd", p, vals).reshape(-1).to(dt)
        o = (attn.float() @ model["w_o"][layer].float().T).to(dt)
        h = (o.float() + h.float()).to(dt)
        gu = (rms(h, model["ln2"][layer]).float() @ model["w_gu"][layer].float().T).to(dt).float()
        act = (F.silu(gu[:, :INTER]) * gu[:, INTER:]).to(dt)
        down = (act.float() @ model["w_down"][layer].float().T).to(dt)
        h = (down.float() + h.float()).to(dt)
    return h, kc, vc


class Step:
    "Buffers and one launch of the persistent kernel for a batch; `run()` is graph-capturable."

    def __init__(self, shape, model, batch, programs, splits, block_n=64, tiles=(32, 16, 32, 16), warps=8, stages=2,
                 prefetch=False, lm_head=True, kc=256, parts=31, timeline=False, k_stages=3,
                 preload=False):  # fmt: skip
        self.shape, self.model, self.batch = shape, model, batch
        L, H, QH, KVH, D, INTER = (shape[k] for k in ("L", "H", "QH", "KVH", "D", "INTER"))
        B = batch["h"].shape[0]
        dev, dt = batch["h"].device, batch["h"].dtype
        self.B, self.P, self.S = B, programs, splits
        self.gp = max(16, triton.next_power_of_2(QH // KVH))
        items = B * KVH * splits
        self.h = torch.empty(2 * L + 1, B, H, dtype=dt, device=dev)
        self.h[0] = batch["h"]
        self.qkv = torch.empty(L, B, (QH + 2 * KVH) * D, dtype=dt, device=dev)
        self.qs = torch.empty(L, items, self.gp, D, dtype=dt, device=dev)
        self.attn = torch.empty(L, B, QH * D, dtype=dt, device=dev)
        self.act = torch.empty(L, B, INTER, dtype=dt, device=dev)
        self.part_out = torch.empty(L, B * QH * splits, D, dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(L, B * QH * splits, dtype=torch.float32, device=dev)
        self.counts = torch.zeros(1 + L * B * KVH, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.k_cache, self.v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
        self.tiles, self.block_n, self.warps, self.stages, self.prefetch = tiles, block_n, warps, stages, prefetch
        self.k_stages, self.preload = k_stages, preload
        self.down_ka = 1 << (INTER.bit_length() - 1)  # INTER = down_ka + down_kb, powers of two (preload)
        if preload and (INTER - self.down_ka) & (INTER - self.down_ka - 1):
            raise ValueError(f"preload needs an intermediate size of at most two powers of two, got {INTER}")
        self.parts = parts  # which stages run (bits: qkv, attention, o, gate/up, down): the rest is barriers
        self.times = torch.zeros(programs, 5 * L + 1, 2, dtype=torch.int64, device=dev) if timeline else None
        self.lm_head = lm_head
        self.kc = min(kc, INTER & -INTER)  # a power of two dividing every product's inputs

    def run(self):
        s, m, b = self.shape, self.model, self.batch
        self.counts.zero_()
        bn_qkv, bn_o, bn_gu, bn_down = self.tiles
        _persistent_decode_kernel[(self.P,)](
            self.h, self.qkv, self.qs, self.attn, self.act, self.part_out, self.part_lse, self.counts, self.err,
            self.err if self.times is None else self.times,
            m["w_qkv"], m["w_o"], m["w_gu"], m["w_down"], m["ln1"], m["ln2"], m["qn"], m["kn"], m["cos_sin"],
            self.k_cache, self.v_cache, b["tables"], b["context_lens"],
            self.B, b["tables"].stride(0), self.k_cache.stride(0), (s["D"] ** -0.5) * math.log2(math.e), EPS,
            L=s["L"], H=s["H"], QH=s["QH"], KVH=s["KVH"], D=s["D"], INTER=s["INTER"], KC=self.kc,
            PAGE=self.k_cache.shape[2], BM=max(16, triton.next_power_of_2(self.B)), GP=self.gp, S=self.S,
            BLOCK_N=self.block_n, BN_QKV=bn_qkv, BN_O=bn_o, BN_GU=bn_gu, BN_DOWN=bn_down,
            PREFETCH=self.prefetch and not INTERPRET, DOT_FP32=INTERPRET and self.h.dtype == torch.bfloat16,
            PARTS=self.parts, TIMELINE=self.times is not None, ACQUIRE_LOADS=not INTERPRET,
            K_STAGES=self.k_stages, PRELOAD=self.preload, DOWN_KA=self.down_ka, DOWN_KB=s["INTER"] - self.down_ka,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        if self.lm_head:
            return F.linear(rms(self.h[-1], m["norm"]), m["lm_head"])
        return self.h[-1]


def check(shape, device, dtype, batch_size, context, page, splits, **kw) -> dict:
    "The kernel against `reference`: largest differences over largest values (h, the new K and V)."
    model = make_model(shape, device, dtype)
    batch = make_batch(shape, batch_size, context, page, device, dtype)
    step = Step(shape, model, batch, programs=kw.pop("programs", 1), splits=splits, lm_head=False, **kw)
    got = step.run()
    want, kc, vc = reference(shape, model, batch)
    if device == "cuda":
        torch.cuda.synchronize()
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())  # noqa: E731
    return dict(h=rel(got, want), k=rel(step.k_cache, kc), v=rel(step.v_cache, vc), err=int(step.err.item()))


def hopper_usage(
    batch=8, splits=2, block_n=64, warps=8, stages=2, kc=256, parts=31, preload=False, tiles=(32, 16, 32, 16)
) -> dict:
    "The kernel compiled for sm_90 on any machine (Qwen3-0.6B's shapes, bfloat16): registers, stack, shared memory."
    from kernel_ptx import cubin_usage  # (tools/ is first on the path of a tool run as a script)
    from triton.backends.compiler import GPUTarget

    s = QWEN3_06B
    fp32 = ("part_out_ptr", "part_lse_ptr", "cos_sin_ptr")
    signature, attrs = {}, {}
    for i, name in enumerate(_persistent_decode_kernel.arg_names):
        if name.endswith("_ptr"):
            signature[name] = (
                "*fp32"
                if name in fp32
                else "*i32"
                if name in ("count_ptr", "err_ptr", "block_tables_ptr", "context_lens_ptr")
                else "*bf16"
            )
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("B", "stride_bt", "stride_cache_layer"):
            signature[name] = "i32"
        elif name in ("qk_scale", "eps"):
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr"
    constants = dict(L=s["L"], H=s["H"], QH=s["QH"], KVH=s["KVH"], D=s["D"], INTER=s["INTER"], KC=kc)
    constants.update(PAGE=16, BM=max(16, triton.next_power_of_2(batch)), GP=16, S=splits, BLOCK_N=block_n)
    constants.update(
        BN_QKV=tiles[0],
        BN_O=tiles[1],
        BN_GU=tiles[2],
        BN_DOWN=tiles[3],
        PREFETCH=False,
        DOT_FP32=False,
        PARTS=parts,
        K_STAGES=3,
    )
    constants.update(PRELOAD=preload, DOWN_KA=2048, DOWN_KB=1024)
    src = triton.compiler.ASTSource(
        fn=_persistent_decode_kernel, signature=signature, constexprs=constants, attrs=attrs
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps, num_stages=stages))
    return dict(**cubin_usage(kernel), shared=kernel.metadata.shared)


def stage_times(times: torch.Tensor, L: int) -> dict:
    """From a TIMELINE run's clocks [P, 5 L + 1, 2]: per stage kind, mean us a layer of the critical path (leaving
    the barrier before to leaving the barrier after) and of the slowest program's work (leaving to arriving)."""
    t = times.double().cpu()
    start, end = t[:, 5 * L, 0].median(), t[:, 5 * L, 1].median()
    leave = torch.cat([start.view(1), t[:, : 5 * L - 1, 1].median(0).values, end.view(1)])  # 5 L + 1 marks
    arrive = torch.cat([t[:, : 5 * L - 1, 0], t[:, 5 * L : 5 * L + 1, 1]], 1)  # the last stage "arrives" at the end
    out = {"total_us": float(end - start) / 1e3}
    for j, kind in enumerate(("qkv", "attention", "o", "gate_up", "down")):
        idx = list(range(j, 5 * L, 5))
        path = [(leave[i + 1] - leave[i]).item() for i in idx]
        work = [(arrive[:, i].max() - leave[i]).item() for i in idx]
        out[kind] = {"path_us": sum(path) / len(idx) / 1e3, "slowest_work_us": sum(work) / len(idx) / 1e3}
    return out


def bench(fn, rep=200) -> float:
    "Median ms of graph replays."
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def torch_chain(shape, model, batch, step: Step):
    "The same step as a chain of plain kernels (cuBLAS products, torch elementwise ops, attention by SDPA)."
    L, QH, KVH, D, INTER = (shape[k] for k in ("L", "QH", "KVH", "D", "INTER"))
    B, ctx = batch["h"].shape[0], int(batch["context_lens"][0])
    page = batch["k_cache"].shape[2]
    blocks = batch["tables"].long()
    cos, sin = model["cos_sin"][ctx - 1].chunk(2, -1)

    def run():
        h = step.h[0]
        for layer in range(L):
            qkv = F.linear(rms(h, model["ln1"][layer]), model["w_qkv"][layer])
            q = rotate(qkv[:, : QH * D].view(B, QH, D), model["qn"][layer], cos, sin).to(h.dtype)
            k = rotate(qkv[:, QH * D : (QH + KVH) * D].view(B, KVH, D), model["kn"][layer], cos, sin).to(h.dtype)
            v = qkv[:, (QH + KVH) * D :].view(B, KVH, D)
            step.k_cache[layer, blocks[:, (ctx - 1) // page], (ctx - 1) % page] = k
            step.v_cache[layer, blocks[:, (ctx - 1) // page], (ctx - 1) % page] = v
            keys = step.k_cache[layer][blocks].view(B, -1, KVH, D)[:, :ctx].transpose(1, 2)
            vals = step.v_cache[layer][blocks].view(B, -1, KVH, D)[:, :ctx].transpose(1, 2)
            a = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, enable_gqa=True)
            h = h + F.linear(a.reshape(B, QH * D), model["w_o"][layer])
            gu = F.linear(rms(h, model["ln2"][layer]), model["w_gu"][layer])
            h = h + F.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], model["w_down"][layer])
        return F.linear(rms(h, model["norm"]), model["lm_head"])

    return run


def lm_head(h, model):
    return F.linear(rms(h, model["norm"]), model["lm_head"])


def weight_bytes(shape: dict) -> int:
    L, H, QH, KVH, D, INTER, V = (shape[k] for k in ("L", "H", "QH", "KVH", "D", "INTER", "V"))
    return 2 * (L * (H * (QH + 2 * KVH) * D + QH * D * H + 3 * H * INTER) + V * H)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--tiles", default="32,16,32,16", help="weight rows a program's tile holds: qkv,o,gate_up,down")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 (no GPU needed): registers, stack")
    ap.add_argument(
        "--configs",
        nargs="*",
        default=None,
        help="splits:block_n:warps:stages:prefetch[:parts[:k_stages[:preload]]], e.g. 2:64:8:2:0 (parts 0: barriers)",
    )
    args = ap.parse_args()
    result: dict = {"args": vars(args)}
    if args.compile_only:
        result["sm90"] = hopper_usage()
        print(result, flush=True)
        json.dump(result, open(args.out, "w"), indent=1)
        return
    if INTERPRET or not torch.cuda.is_available():
        result["check_cpu"] = {f"S{s}": check(TINY, "cpu", torch.float32, 3, 40, 16, s, block_n=16) for s in (1, 2)}
        print(result, flush=True)
        json.dump(result, open(args.out, "w"), indent=1)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result["environment"] = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, sms=sms
    )
    two_layers = dict(QWEN3_06B, L=2)
    result["check_gpu"] = {
        f"B{b}_S{s}": check(two_layers, "cuda", torch.bfloat16, b, args.context, args.page, s, programs=sms)
        for b in (8, 32)
        for s in (1, 2)
    }
    for b in (8, 32):  # weights held in registers across the barriers
        result["check_gpu"][f"B{b}_S2_preload"] = check(
            two_layers, "cuda", torch.bfloat16, b, args.context, args.page, 2, programs=sms, preload=True
        )
    print("check", result["check_gpu"], flush=True)
    if args.check_only:
        json.dump(result, open(args.out, "w"), indent=1)
        return
    configs = args.configs or ["2:64:8:2:0", "2:64:8:2:0:0", "2:64:8:2:0:2", "2:64:8:2:0:29", "4:32:8:2:0"]  # fmt: skip
    shape = QWEN3_06B
    model = make_model(shape, "cuda", torch.bfloat16)
    result["batches"] = {}
    for b in args.batches:
        batch = make_batch(shape, b, args.context, args.page, "cuda", torch.bfloat16)
        kv_bytes = 2 * 2 * shape["L"] * shape["KVH"] * shape["D"] * b * args.context
        r = {"bytes": weight_bytes(shape) + kv_bytes}
        base = Step(shape, model, batch, sms, 1)
        r["torch_chain_ms"] = bench(torch_chain(shape, model, batch, base))
        r["lm_head_ms"] = bench(functools.partial(lm_head, base.h[0], model))
        for cfg in configs:
            fields = [int(v) for v in cfg.split(":")]
            s, bn, w, st, pf, parts, ks, pre = fields + [31, 3, 0][len(fields) - 5 :]
            opts = dict(block_n=bn, warps=w, stages=st, prefetch=bool(pf), parts=parts, k_stages=ks, preload=bool(pre))
            opts["tiles"] = tuple(int(v) for v in args.tiles.split(","))
            step = Step(shape, model, batch, sms, s, **opts)
            try:
                step.run()
                torch.cuda.synchronize()
                ms = bench(step.run)
                r[cfg] = {"ms": ms, "err": int(step.err.item())}
                if cfg == configs[0]:  # where the time goes, from the GPU's clock at each barrier
                    timed = Step(shape, model, batch, sms, s, timeline=True, **opts)
                    for _ in range(3):
                        timed.run()
                    torch.cuda.synchronize()
                    r["stages"] = stage_times(timed.times, shape["L"])
                    print(b, "stages", r["stages"], flush=True)
            except Exception as e:  # a launch that does not fit
                r[cfg] = {"error": str(e)[:300]}
            print(b, cfg, r[cfg], flush=True)
        print(b, "torch chain", round(r["torch_chain_ms"], 3), "lm_head", round(r["lm_head_ms"], 3), flush=True)
        result["batches"][b] = r
        json.dump(result, open(args.out, "w"), indent=1)
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
