"""The paged decode kernel's tiles on a GPU, for a bf16 and an 8-bit (e4m3) cache: GB/s by launch configuration.

    python tools/decode_sweep.py --out decode_tiles.json
    python tools/decode_sweep.py --cache fp8 --shapes 256x512,512x256   # one cache dtype, some batch x context shapes

Each shape is a decode step of Qwen3-0.6B's heads (16 query, 8 KV, 128 dims, blocks of 16 scattered in the cache):
`batch` sequences at `context` tokens each, timed as CUDA graph replays (`minivllm.kernels.bench.bench_decode`, as the
engine runs decode). The bandwidth counts every byte of K/V read, so an 8-bit cache's GB/s compare with the copy
rate directly. Each configuration's output is checked against the default's (max abs difference). The question: which
tile (`block_n`), warps and pipeline stages the 8-bit cache should take, since at 256 sequences of 512 tokens its
kernel reaches about half the copy rate where bf16's reaches 90% (docs/speed.md).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from minivllm.bench import environment
from minivllm.kernels import decode_plan
from minivllm.kernels.bench import bench_decode
from minivllm.kernels.paged_decode import paged_decode_attention

SHAPES = "256x512,512x256,128x1024,32x1024,8x1024"
CONFIGS = [
    dict(block_n=n, num_warps=w, num_stages=s) for n, w, s in itertools.product((64, 128, 256), (4, 8), (1, 2, 3, 4))
]
CACHES = {"bf16": None, "fp8": torch.float8_e4m3fn}


def defaults(cache: str) -> dict:
    "The launch configuration the engine uses today for this cache dtype."
    eight_bit = cache == "fp8"
    return dict(
        block_n=decode_plan.DECODE_BLOCK_N_8BIT if eight_bit else decode_plan.DECODE_BLOCK_N,
        num_warps=decode_plan.DECODE_NUM_WARPS,
        num_stages=decode_plan.DECODE_NUM_STAGES_8BIT if eight_bit else decode_plan.DECODE_NUM_STAGES,
    )


def small_step(cache: str) -> tuple:
    "A decode step of 4 sequences of different lengths over scattered blocks, in the cache dtype."
    g = torch.Generator(device="cuda").manual_seed(0)
    lens, block = [300, 517, 1000, 64], 16
    blocks = [-(-n // block) for n in lens]
    shape = (sum(blocks), block, 8, 128)
    kc, vc = (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if CACHES[cache] is not None:
        kc, vc = kc.to(CACHES[cache]), vc.to(CACHES[cache])
    perm = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(0)).tolist()
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(perm[sum(blocks[:i]) : sum(blocks[: i + 1])])
    q = torch.randn(len(lens), 16, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, torch.tensor(lens, dtype=torch.int32, device="cuda"), tables.cuda()


def max_diff(step: tuple, cfg: dict, ref: torch.Tensor) -> float:
    q, kc, vc, lens, tables = step
    return (paged_decode_attention(q, kc, vc, lens, tables, 128**-0.5, **cfg).float() - ref.float()).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", choices=["bf16", "fp8", "both"], default="both")
    ap.add_argument("--shapes", default=SHAPES, help="batch x context, comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_sweep.py times the kernel on a CUDA GPU; none is visible")
    caches = list(CACHES) if args.cache == "both" else [args.cache]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    results = []
    for cache, (batch, context) in itertools.product(caches, shapes):
        base, step = defaults(cache), small_step(cache)
        q, kc, vc, lens, tables = step
        ref = paged_decode_attention(q, kc, vc, lens, tables, 128**-0.5)
        rows = [("default", base)] + [("sweep", cfg) for cfg in CONFIGS if cfg != base]
        for label, cfg in rows:
            try:
                diff = max_diff(step, cfg, ref)
                r = bench_decode(batch, context, cache_dtype=CACHES[cache], cuda_graph=True, **cfg)
            except Exception as e:  # noqa: BLE001 (a configuration that does not fit in shared memory: noted, skipped)
                print(f"{cache} {batch}x{context} {cfg}: {type(e).__name__}")
                continue
            row = dict(cache=cache, batch=batch, context=context, label=label, **cfg, ms=r["ms"], gbps=r["gbps"])
            row["max_diff"] = diff
            results.append(row)
            if label == "default":
                print(json.dumps(row), flush=True)
        mine = [r for r in results if r["cache"] == cache and (r["batch"], r["context"]) == (batch, context)]
        best = max(mine, key=lambda r: r["gbps"])
        print(f"best {cache} {batch}x{context}: {json.dumps(best)} ({best['gbps'] / mine[0]['gbps']:.2f}x the default)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment(), defaults={c: defaults(c) for c in caches}, results=results), f)


if __name__ == "__main__":
    main()
