"""The paged prefill kernel's tiles on a GPU: time per layer and TFLOP/s of causal attention, by launch configuration.

    python tools/prefill_sweep.py --out figures/06_prefill_tiles_h200.json
    python tools/prefill_sweep.py --before old_paged_prefill.py --out ...   # also an earlier version of the kernel

Shapes (Qwen3-0.6B's heads: 16 query, 8 KV, 128 dims, bfloat16, blocks of 16 scattered in the cache):
- `prefill 16x1024`: 16 prompts of 1,024 tokens, no cached prefix (the 16,384-token prefill step of the bench);
- `mixed 255+256`: 255 sequences decoding at context 1,024 and one 256-token prompt (`skip_single`: the kernel runs
  only the prompt's programs; the decode kernel takes the rest, notebook 06);
- `prefill 4x4096`: 4 prompts of 4,096 tokens.
Each configuration's output is checked against the default's (max abs difference printed); the FLOPs counted are the
causal ones (QK^T and PV over the positions each query sees).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json

import torch
import triton.testing

from minivllm.bench import environment
from minivllm.kernels import paged_prefill
from minivllm.layers.attention import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 16
SHAPES = {
    "prefill 16x1024": ([1024] * 16, [1024] * 16),
    "mixed 255+256": ([1] * 255 + [256], [1024] * 255 + [256]),
    "prefill 4x4096": ([4096] * 4, [4096] * 4),
}
CONFIGS = [
    dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
]


def make_step(q_lens: list[int], ctx_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in ctx_lens]
    perm = torch.randperm(sum(need), generator=g).tolist()
    tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    shape = (sum(need), BLOCK, KV_HEADS, DIM)
    kc = torch.randn(shape, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(shape, generator=g).to("cuda", torch.bfloat16)
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, BLOCK, device="cuda")
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
    return q, kc, vc, meta


def causal_flops(q_lens: list[int], ctx_lens: list[int]) -> float:
    "QK^T and PV: 4 * dim FLOPs per (query head, visible position); only prompts (q_len > 1) go to this kernel."
    seen = sum(sum(c - q + 1 + t for t in range(q)) for q, c in zip(q_lens, ctx_lens) if q > 1)
    return 4.0 * DIM * HEADS * seen


def prefill(step, skip: bool, module=paged_prefill, **cfg) -> torch.Tensor:
    "`module`'s paged_prefill_attention on a step from `make_step`, at launch configuration `cfg`."
    q, kc, vc, m = step
    return module.paged_prefill_attention(
        q, kc, vc, m.cu_seqlens_q, m.context_lens, m.block_tables, DIM**-0.5, skip_single=skip, **cfg
    )


def time_us(fn) -> float:
    fn()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="a .py file with an earlier paged_prefill_attention, timed too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    before = None
    if args.before:
        spec = importlib.util.spec_from_file_location("prefill_before", args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
    results = []
    for name, (q_lens, ctx_lens) in SHAPES.items():
        step = make_step(q_lens, ctx_lens)
        skip = name.startswith("mixed")
        flops = causal_flops(q_lens, ctx_lens)
        run = functools.partial(prefill, step, skip)
        rows_checked = slice(len(q_lens) - 1, None) if skip else slice(None)  # (skipped rows stay unwritten)
        ref = run()[rows_checked]
        rows = [("default", {}, paged_prefill)] + [("sweep", cfg, paged_prefill) for cfg in CONFIGS]
        if before is not None:
            rows.insert(0, ("before", {}, before))
        for label, cfg, module in rows:
            try:
                us = time_us(functools.partial(run, module, **cfg))
                err = (run(module, **cfg)[rows_checked].float() - ref.float()).abs().max().item()
            except Exception as e:  # a configuration that does not compile (shared memory): noted, skipped
                print(f"{name} {label} {cfg}: {type(e).__name__}")
                continue
            row = dict(shape=name, label=label, **cfg, us=us, tflops=flops / us / 1e6, max_diff=err)
            results.append(row)
            if label != "sweep":
                print(json.dumps(row), flush=True)
        best = min((r for r in results if r["shape"] == name), key=lambda r: r["us"])
        print("best:", json.dumps(best), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    environment=environment(),
                    heads=HEADS,
                    kv_heads=KV_HEADS,
                    dim=DIM,
                    block_size=BLOCK,
                    defaults=dict(
                        block_m=paged_prefill.PREFILL_BLOCK_M,
                        block_n=paged_prefill.PREFILL_BLOCK_N,
                        num_warps=paged_prefill.PREFILL_NUM_WARPS,
                        num_stages=paged_prefill.PREFILL_NUM_STAGES,
                    ),
                    results=results,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
