from __future__ import annotations

import functools
import importlib.util
import os

import torch

# Triton reads TRITON_INTERPRET once, when a kernel is defined (at import): so do we.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BACKENDS = ("torch", "triton", "flash_attn")
BACKEND_ENV = "MINIVLLM_ATTENTION_BACKEND"
FLASH_ATTN_PAGE_MULTIPLE = 256   # flash-attn's paged KV needs block_size % 256 == 0


@functools.cache   # what is installed does not change while the process runs
def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # not installed, or built for another torch / CUDA
        return False
    return True


def _unavailable_reason(backend: str, device: torch.device, block_size: int | None) -> str | None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if backend == "triton" and device.type != "cuda" and not INTERPRET:
        return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1), got {device.type}"
    if backend == "flash_attn":
        if device.type != "cuda":
            return f"flash-attn needs a CUDA device, got {device.type}"
        if not flash_attn_available():
            return "flash_attn is not importable"
        if block_size is not None and block_size % FLASH_ATTN_PAGE_MULTIPLE:
            return f"flash-attn's paged KV needs block_size % {FLASH_ATTN_PAGE_MULTIPLE} == 0, got {block_size}"
    return None

# %%
def select_backend(device: torch.device | str, block_size: int | None = None, requested: str | None = None) -> str:
    "The attention backend for `device` and `block_size`: `requested`, else MINIVLLM_ATTENTION_BACKEND, else auto."
    device, requested = torch.device(device), requested or os.environ.get(BACKEND_ENV) or "auto"
    if requested not in BACKENDS + ("auto",):
        raise ValueError(f"unknown attention backend {requested!r}: choose one of {', '.join(BACKENDS)} (or auto)")
    if requested != "auto":
        reason = _unavailable_reason(requested, device, block_size)
        if reason:
            raise ValueError(f"attention backend {requested!r} is not available here: {reason} (choices: "
                             f"{', '.join(BACKENDS)} or auto, by {BACKEND_ENV} or attention_backend=...)")
        return requested
    if device.type != "cuda":
        return "torch"
    for backend in ("flash_attn", "triton"):
        if _unavailable_reason(backend, device, block_size) is None:
            return backend
    return "torch"
