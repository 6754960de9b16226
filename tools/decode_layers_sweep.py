"""The paged decode kernel at small batches, timed as a decode step runs it: one launch per layer over that layer's own
cache, all layers in one CUDA graph, so no layer finds its keys in the L2 cache (a batch of 8 at 1,024 tokens holds
33.5 MB a layer, less than an H100's 50 MB of L2). Per launch configuration (tile, warps, stages, splits of each
sequence's KV), the time a layer and the bandwidth it reaches, beside the engine's choice.

    python tools/decode_layers_sweep.py OUT.json                         # 8x1024 and 32x1024, Qwen3-0.6B's heads
    python tools/decode_layers_sweep.py OUT.json --shapes 8x1024 --splits 4,8,16 --tiles 64 --warps 4 --stages 3

The engine chooses the splits from the block table's width (its capacity, `--capacity`, 4,096 tokens in the
benchmark), not from the context, so the default row uses that plan. Each configuration's output is checked against
the default's on the first layer (max abs difference).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import triton
import triton.testing

from minivllm.bench import environment
from minivllm.kernels import decode_plan
from minivllm.kernels.paged_decode import paged_decode_attention

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16


def layered_case(batch: int, context: int, layers: int, seed: int = 0, device: str = "cuda") -> dict:
    "Per layer a random cache of `batch` sequences of `context` tokens in scattered blocks, and its queries."
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = batch * triton.cdiv(context, PAGE)
    shape = (blocks, PAGE, KV_HEADS, DIM)
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16)

    return dict(
        q=[rand(batch, HEADS, DIM) for _ in range(layers)],
        k=[rand(*shape) for _ in range(layers)],
        v=[rand(*shape) for _ in range(layers)],
        out=[torch.empty(batch, HEADS, DIM, device=device, dtype=torch.bfloat16) for _ in range(layers)],
        lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        tables=perm.view(batch, -1).to(device, torch.int32),
        bytes_per_layer=2 * batch * context * KV_HEADS * DIM * 2,
    )


def time_layers(case: dict, cfg: dict) -> float:
    "Microseconds a layer: every layer's launch back to back in one CUDA graph, the median of its replays."

    def run():
        for q, k, v, out in zip(case["q"], case["k"], case["v"], case["out"]):
            paged_decode_attention(q, k, v, case["lens"], case["tables"], DIM**-0.5, out=out, **cfg)

    run()
    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=300, return_mode="median") / len(case["q"])


def first_layer(case: dict, cfg: dict) -> torch.Tensor:
    return paged_decode_attention(
        case["q"][0], case["k"][0], case["v"][0], case["lens"], case["tables"], DIM**-0.5, **cfg
    )


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shapes", default="8x1024,32x1024", help="batch x context, comma-separated")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--capacity", type=int, default=4096, help="the block table's width in tokens, as the engine's")
    ap.add_argument("--tiles", default="64,128,32")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,2")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument(
        "--seconds", type=float, default=400, help="for all shapes: each stops starting configurations after its share"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_layers_sweep.py times the kernel on a CUDA GPU; none is visible")
    results, shapes = [], args.shapes.split(",")
    sms = decode_plan.num_sms(torch.device("cuda"))
    for shape in shapes:
        start, batch, context = time.time(), *map(int, shape.split("x"))
        case = layered_case(batch, context, args.layers)
        plan = decode_plan.choose_num_splits(batch, KV_HEADS, args.capacity, decode_plan.DECODE_BLOCK_N, sms)
        default = dict(
            block_n=decode_plan.DECODE_BLOCK_N,
            num_warps=decode_plan.DECODE_NUM_WARPS,
            num_stages=decode_plan.DECODE_NUM_STAGES,
            num_splits=plan,
        )
        ref = first_layer(case, default)
        grid = itertools.product(ints(args.tiles), ints(args.warps), ints(args.stages), ints(args.splits))
        configs = [default] + [dict(block_n=n, num_warps=w, num_stages=s, num_splits=p) for n, w, s, p in grid]
        for i, cfg in enumerate(configs):
            if time.time() - start > args.seconds / len(shapes):
                print("time budget spent: stopping", flush=True)
                break
            if i and cfg == default:
                continue
            try:
                diff = (first_layer(case, cfg).float() - ref.float()).abs().max().item()
                us = time_layers(case, cfg)
            except Exception as e:  # noqa: BLE001 (a configuration that does not fit in shared memory: noted, skipped)
                print(f"{shape} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row = dict(
                batch=batch,
                context=context,
                label="engine" if i == 0 else "sweep",
                **cfg,
                us=us,
                gbps=case["bytes_per_layer"] / us / 1e3,
                max_diff=diff,
            )
            results.append(row)
            print(json.dumps(row), flush=True)
        mine = [r for r in results if (r["batch"], r["context"]) == (batch, context)]
        for r in sorted(mine, key=lambda r: r["us"])[:5]:
            print(f"best {shape}: {r['us']:.2f} us ({r['us'] / mine[0]['us']:.3f} of the engine's) {r}", flush=True)
        del case
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            command = "python " + " ".join(sys.argv)
            json.dump(dict(command=command, args=vars(args), environment=environment(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
