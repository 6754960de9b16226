"""Host memory on a CPU: the KV cache starts as zeros (the CPU decode relies on it), and `reuse_freed_memory` stops
glibc from handing every step fresh pages to fault in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minivllm.engine.host_memory import reuse_freed_memory
from minivllm.engine.kv_cache import allocate_kv_cache, zeroed_cpu_tensor
from minivllm.layers.attention import Attention

linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")


def test_zeroed_cpu_tensor_is_zeros_of_the_shape_and_dtype_asked_for():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = zeroed_cpu_tensor((2, 3, 5, 4), dtype)
        assert t.shape == (2, 3, 5, 4) and t.dtype == dtype and bool((t.float() == 0).all())
        t[1, 2] = 1  # writable, like any tensor
        assert t.float().sum() == 20


def test_cpu_kv_cache_starts_zeroed_even_where_freed_memory_held_nan():
    reuse_freed_memory()  # freed blocks stay in the heap: a new torch.empty there would hold the NaN below
    for _ in range(3):
        torch.full((1 << 22,), float("nan"))
    model = torch.nn.ModuleList([Attention(4, 16, 0.25, 2), Attention(4, 16, 0.25, 2)])
    kv = allocate_kv_cache(model, num_blocks=1024, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    assert kv.shape == (2, 2, 1024, 16, 2, 16) and bool((kv == 0).all())
    assert model[1].v_cache.data_ptr() == kv[1, 1].data_ptr()


@linux_glibc
@pytest.mark.timeout(120)
def test_reuse_freed_memory_ends_the_page_faults_of_repeated_large_temporaries():
    script = textwrap.dedent("""
        import resource, torch
        from minivllm.engine.host_memory import reuse_freed_memory
        x, w = torch.randn(4096, 384), torch.randn(384, 2048)
        def faults():
            for _ in range(3):
                (x @ w).sigmoid()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(5):
                (x @ w).sigmoid()   # two 32 MiB temporaries per call, freed at once
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        default = faults()
        print(reuse_freed_memory(), default, faults())
    """)
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_MALLOC_REUSE"}  # glibc's defaults, then the change
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100, check=True, env=env
    )
    took, default, reused = out.stdout.split()
    assert took == "True"
    assert int(default) > 5 * 8000 and int(reused) < int(default) / 100, out.stdout


def test_reuse_freed_memory_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MINIVLLM_MALLOC_REUSE", "0")
    assert reuse_freed_memory() is False
