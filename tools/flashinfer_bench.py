"""FlashInfer, the kernel library vLLM serves with, against minivllm's Triton kernels on the same paged cache; GPU only.

The cache is `minivllm.kernels.bench.paged_case` (Qwen3-0.6B's 16 query / 8 KV heads of 128 dims, blocks of 16,
bfloat16, blocks scattered in memory). FlashInfer reads it as it is: its "NHD" layout of a paged cache is minivllm's
`[num_blocks, block_size, kv_heads, head_dim]`, the pages of sequence `i` are its block-table row, and the last page
holds `(context - 1) % block_size + 1` tokens (`minivllm.kernels.bench.flashinfer_paged_call`, notebook 06). Decode:
`BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`; prefill over a cached prefix:
`BatchPrefillWithPagedKVCacheWrapper(causal=True)` (FlashInfer picks its sm90 kernel on Hopper). Each output is compared
with minivllm's; times are medians in microseconds, launched from Python (`triton.testing.do_bench`, the method of
notebook 06's side by side) and, for decode, from a CUDA graph (`do_bench_cudagraph`: how the engine runs a decode
step).

    pip install flashinfer-python        # its kernels are compiled on first use (nvcc and ninja needed)
    python tools/flashinfer_bench.py --out figures/06_flashinfer_side_by_side_h200.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from minivllm.kernels.bench import bench_attention, flashinfer_paged_call, paged_case, triton_paged_call

DECODE = [(batch, context) for batch in (1, 32, 256) for context in (1024, 4096, 8192)]
PREFILL = [(1, 2048, 2048), (1, 16384, 16384), (4, 2048, 4096), (8, 512, 2048), (1, 1024, 8192)]  # batch, new, ctx


def side_by_side(batch: int, new: int, context: int, workspace: torch.Tensor, graph: bool) -> dict:
    case = paged_case(batch, context, new)
    fi, tr = flashinfer_paged_call(case, workspace), triton_paged_call(case)
    err = (fi().float() - tr().float()).abs().max().item()
    if graph:
        times = [triton.testing.do_bench_cudagraph(f, rep=100, return_mode="median") * 1e3 for f in (fi, tr)]
    else:
        times = [
            triton.testing.do_bench(fi, warmup=25, rep=100, return_mode="median") * 1e3,
            bench_attention("triton", batch, context, new)["us"],
        ]
    return dict(flashinfer_us=round(times[0], 1), triton_us=round(times[1], 1), max_err=err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flashinfer_bench.py needs a CUDA GPU")
    import flashinfer

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = {
        "flashinfer": flashinfer.__version__,
        "gpu": torch.cuda.get_device_name(),
        "decode_launched": {},
        "decode_cuda_graph": {},
        "prefill_launched": {},
    }
    runs = (
        [("decode_launched", (b, 1, c), False) for b, c in DECODE]
        + [("decode_cuda_graph", (b, 1, c), True) for b, c in DECODE if c != 4096]
        + [("prefill_launched", shape, False) for shape in PREFILL]
    )
    for part, (batch, new, context), graph in runs:
        key = f"{batch}x{context}" if new == 1 else f"{batch}x{new}/{context}"
        r = results[part][key] = side_by_side(batch, new, context, workspace, graph)
        print(
            f"{part:18} {key:12} flashinfer {r['flashinfer_us']:8.1f} us | triton {r['triton_us']:8.1f} us | "
            f"triton/flashinfer {r['triton_us'] / r['flashinfer_us']:.2f} | max error {r['max_err']:.1e}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
