"""The decode kernel under a register cap (`maxnreg`), timed on a GPU against the uncapped kernel in the same run.

    python tools/decode_register_cap.py OUT.json

Compiled for sm_90, the kernel reading an 8-bit cache as float16 tiles (128 keys, 2 stages) takes 248 registers a
thread (Triton 3.7's ptxas -v), so two programs of 4 warps fit an SM by registers; a bfloat16 cache's (64 keys, 3
stages) takes 123. Under a cap of 168 three fit and ptxas spills 120 bytes a thread, under 128 four and 312 bytes.
A decode step waits on memory, and more programs an SM hide more of that wait: each cap below is timed for both caches
at four sizes (one layer, CUDA graph replays, `minivllm.kernels.bench.bench_decode`). A cap changes no arithmetic,
only where ptxas keeps the values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import minivllm.kernels.paged_decode as pd
from minivllm.bench import environment
from minivllm.kernels.bench import bench_decode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import WithOptions  # noqa: E402

SHAPES = [(256, 512), (512, 768), (32, 1024), (8, 4096)]
CAPS = [None, 168, 128]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    args = ap.parse_args()
    orig, results = pd._paged_decode_kernel, []
    for batch, context in SHAPES:
        for cache in ("fp8", "bf16"):
            cache_dtype = torch.float8_e4m3fn if cache == "fp8" else None
            for cap in CAPS:
                pd._paged_decode_kernel = orig if cap is None else WithOptions(orig, maxnreg=cap)
                r = bench_decode(batch=batch, context=context, cuda_graph=True, cache_dtype=cache_dtype)
                row = dict(batch=batch, context=context, cache=cache, maxnreg=cap, us=r["ms"] * 1e3, gbps=r["gbps"])
                results.append(row)
                print(json.dumps(row), flush=True)
            pd._paged_decode_kernel = orig
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
