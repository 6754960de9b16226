from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backends import INTERPRET


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def check_device(*tensors: torch.Tensor) -> None:
    "Compiled kernels need CUDA tensors; the interpreter takes CPU tensors."
    if not INTERPRET and any(t.device.type != "cuda" for t in tensors):
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before minivllm.kernels is "
                         "imported, to run them on CPU tensors in Triton's interpreter)")


def dot_options(dtype: torch.dtype) -> dict:
    "How kernels call `tl.dot` on a cache of `dtype`: exact float32 products for float32, and the interpreter fix."
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_FP32=INTERPRET and dtype == torch.bfloat16)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be alike [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dimension (head_dim)")

# %%
@triton.jit
def online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    "Fold a tile of scores `s` [M, N] (log2 units) and values `v` [N, D] into the running max, sum and output."
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
