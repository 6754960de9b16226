"""A decode step's attention with the q/k norms, rotation and K/V write inside the decode kernel, against the two
kernels it replaces: chained over 28 layers at batch 1, 8 and 32, as CUDA graphs.

    python tools/rope_decode_probe.py OUT.json                        # on a GPU
    TRITON_INTERPRET=1 python tools/rope_decode_probe.py x.json --check-only   # on a CPU: the one kernel against two

Per layer, a decode step ran `qk_norm_rope_store` (a program per token: queries normed and rotated, keys normed and
rotated and values written into the cache), then the decode kernel, which read q. `rope_decode_attention` (notebook
06's small-batch deep dive) does both in one kernel: each decode program norms and rotates its own query heads, and
the one that reads the new position writes its K and V first. Arms: `pair` (the two kernels, in the tiles the package
chooses: `decode_tiles`), `pair_plain` (the two in the 64-position tiles every batch took before), `fused`. At the
commit the figure names (figures/52_rope_decode_probe_h100.json) the fused kernel was this tool's own copy, and the
narrow tiles an arm of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton

from minivllm.kernels.decode_plan import DECODE_BLOCK_N, DECODE_NUM_STAGES, DECODE_NUM_WARPS
from minivllm.kernels.paged_decode import paged_decode_attention
from minivllm.kernels.qk_norm_rope import qk_norm_rope_store
from minivllm.kernels.rope_decode import rope_decode_attention

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def rope_decode(layer: dict, meta: dict) -> torch.Tensor:
    "The package's one kernel (`rope_decode_attention`) on one of the probe's layers."
    return rope_decode_attention(
        layer["qkv"], (HEADS, KV_HEADS, DIM), (layer["q_w"], layer["k_w"], 1e-6), meta["cos_sin"], meta["positions"],
        meta["slots"], layer["k_cache"], layer["v_cache"], meta["context_lens"], meta["block_tables"], DIM**-0.5,
    )  # fmt: skip


def pair_decode(layer: dict, meta: dict, tiles: dict | None = None) -> torch.Tensor:
    "The engine's two kernels: `qk_norm_rope_store`, then `paged_decode_attention` (with its merge)."
    q = qk_norm_rope_store(
        layer["qkv"], HEADS, KV_HEADS, DIM, layer["q_w"], layer["k_w"], 1e-6, meta["cos_sin"], meta["positions"],
        meta["slots"], layer["k_cache"], layer["v_cache"],
    )  # fmt: skip
    return paged_decode_attention(
        q, layer["k_cache"], layer["v_cache"], meta["context_lens"], meta["block_tables"], DIM**-0.5,
        out=layer["out"], **(tiles or {}),
    )  # fmt: skip


PLAIN_TILES = dict(block_n=DECODE_BLOCK_N, num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES)


def cos_sin_table(positions: int, device) -> torch.Tensor:
    inv = 1.0 / (1000000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


def make_step(batch: int, context: int, layers: int, device, seed: int = 0):
    "Random layers (qkv rows, norm weights, caches) and one decode step's metadata: each sequence at `context`."
    dtype = torch.float16 if INTERPRET else torch.bfloat16  # (the interpreter's bfloat16 is wrong)
    g = torch.Generator().manual_seed(seed)
    per_seq = triton.cdiv(context, PAGE)
    blocks = batch * per_seq + 1
    tables = (torch.randperm(blocks - 1, generator=g)[: batch * per_seq] + 1).view(batch, per_seq).to(torch.int32)
    last = context - 1
    slots = tables[:, last // PAGE].to(torch.int64) * PAGE + last % PAGE
    meta = dict(
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        positions=torch.full((batch,), last, dtype=torch.int64, device=device),
        slots=slots.to(device),
        cos_sin=cos_sin_table(context + 1, device),
    )
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype).to(device)  # noqa: E731
    out = []
    for _ in range(layers):
        out.append(
            dict(
                qkv=rand(batch, (HEADS + 2 * KV_HEADS) * DIM),
                q_w=(1 + rand(DIM, s=0.1).float()).to(dtype),
                k_w=(1 + rand(DIM, s=0.1).float()).to(dtype),
                k_cache=rand(blocks, PAGE, KV_HEADS, DIM),
                v_cache=rand(blocks, PAGE, KV_HEADS, DIM),
                out=torch.empty(batch, HEADS, DIM, dtype=dtype, device=device),
            )
        )
    return meta, out


def check(batch: int, context: int, device) -> dict:
    "The fused kernel against the pair on one layer: outputs and the written K/V, max abs difference."
    meta, (layer,) = make_step(batch, context, 1, device, seed=batch)
    k0, v0 = layer["k_cache"].clone(), layer["v_cache"].clone()
    ref = pair_decode(layer, meta).float().clone()
    k_ref, v_ref = layer["k_cache"].clone(), layer["v_cache"].clone()
    layer["k_cache"].copy_(k0)
    layer["v_cache"].copy_(v0)
    got = rope_decode(layer, meta).float()
    return dict(
        out=(got - ref).abs().max().item(),
        out_scale=ref.abs().max().item(),
        k=(layer["k_cache"].float() - k_ref.float()).abs().max().item(),
        v=(layer["v_cache"].float() - v_ref.float()).abs().max().item(),
        k_written=(k_ref.float() - k0.float()).abs().max().item(),
    )


def time_arms(arms: dict, replays: int, rounds: int) -> dict:
    "Each arm's chain captured as a CUDA graph; rounds of `replays` replays, arms alternating; median us a chain."
    graphs = {}
    for name, fn in arms.items():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[name] = g
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, g in graphs.items():
            g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000 / replays)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args()
    device = torch.device("cpu" if INTERPRET else "cuda")
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {"context": args.context, "layers": args.layers, "checks": {}, "chains_us": {}}
    if not INTERPRET:
        result["gpu"] = torch.cuda.get_device_name()
        result["torch"], result["triton"] = torch.__version__, triton.__version__
    for batch in batches:
        ctx = min(args.context, 40) if INTERPRET else args.context
        result["checks"][batch] = check(batch, ctx, device)
        print(batch, result["checks"][batch], flush=True)
        if args.check_only:
            continue
        meta, layers = make_step(batch, args.context, args.layers, device)
        arms = {
            "pair": lambda: [pair_decode(layer, meta) for layer in layers],  # noqa: B023 (timed in this iteration)
            "pair_plain": lambda: [pair_decode(layer, meta, PLAIN_TILES) for layer in layers],  # noqa: B023
            "fused": lambda: [rope_decode(layer, meta) for layer in layers],  # noqa: B023
        }
        us = time_arms(arms, args.replays, args.rounds)
        result["chains_us"][batch] = {
            "chain": us,
            "per_layer": {k: v / args.layers for k, v in us.items()},
            "saved_per_layer": {k: (us["pair"] - v) / args.layers for k, v in us.items()},
        }
        print(batch, json.dumps(result["chains_us"][batch]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
