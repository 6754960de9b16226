from __future__ import annotations

import functools

import torch


def fused_on_gpu(fn):
    "Run `fn` compiled by `torch.compile` (its elementwise ops fused into one kernel) on CUDA tensors, as-is elsewhere."
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        return compiled(x, *args, **kwargs) if x.is_cuda else fn(x, *args, **kwargs)
    return wrapper
