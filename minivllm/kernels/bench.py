from __future__ import annotations

import torch
import triton
import triton.testing

from .paged_decode import paged_decode_attention


def _check_cuda(device: str) -> None:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"benchmarks time CUDA kernels: they need a CUDA device, got {device!r}")


def bench_copy(nbytes: int = 4 << 30, device: str = "cuda") -> dict:
    "The card's copy bandwidth: a device-to-device copy of `nbytes`, counted as bytes read + written."
    _check_cuda(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return dict(ms=ms, bytes=2 * src.numel() * 4, gbps=2 * src.numel() * 4 / ms / 1e6)


def bench_decode(batch: int = 256, context: int = 1024, num_heads: int = 16, num_kv_heads: int = 8,
                 head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cuda", seed: int = 0, shared_prefix: int = 0, cascade: bool = False,
                 **kernel_options) -> dict:
    """Time the paged decode kernel on a cache of random, scattered blocks; its achieved bandwidth in GB/s. With
    `shared_prefix`, every sequence's first `shared_prefix` tokens sit in the same blocks; `cascade` reads them once.
    (The bandwidth always counts every sequence's whole context, as plain decode reads it.)"""
    _check_cuda(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq, shared = triton.cdiv(context, block_size), shared_prefix // block_size
    num_blocks = batch * (blocks_per_seq - shared) + shared
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))   # blocks scattered in memory
    block_tables = torch.cat([perm[:shared].expand(batch, shared), perm[shared:].view(batch, -1)], 1)
    block_tables = block_tables.to(device, torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    out = torch.empty_like(q)
    prefix = torch.tensor([shared * block_size], dtype=torch.int32, device=device) if cascade else None
    run = lambda: paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, head_dim ** -0.5,  # noqa
                                         out=out, shared_prefix_len=prefix, **kernel_options)
    run()
    ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = 2 * batch * context * num_kv_heads * head_dim * elem + 2 * q.numel() * elem + block_tables.numel() * 4
    return dict(ms=ms, bytes=nbytes, gbps=nbytes / ms / 1e6)
