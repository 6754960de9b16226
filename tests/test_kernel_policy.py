"""The kernel policy and the attention backends (project issue 47): which kernels run is decided once per engine.

`kernel_policy` turns the device, the dtypes and the backend names `Config` resolved into one frozen `KernelPolicy`;
`apply_policy` hands it to the model; the layers dispatch on it, never on the device. Without a GPU the GPU's policy
still runs here: every fast path is a Triton kernel, interpreted on a CPU (TRITON_INTERPRET is set by conftest.py), so
a GPU policy on a CPU model takes the GPU's dispatch decisions, and must give the reference policy's numbers.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Qwen3Config

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention, AttentionMetadata
from minivllm.layers.attention_backends.base import AttentionBackend, make_attention_backend
from minivllm.layers.attention_backends.flash_backend import FlashAttentionBackend
from minivllm.layers.attention_backends.torch_backend import TorchAttentionBackend
from minivllm.layers.attention_backends.triton_backend import TritonAttentionBackend
from minivllm.layers.embed_head import ParallelLMHead
from minivllm.layers.kernel_policy import KernelPolicy, UsesKernelPolicy, apply_policy, kernel_policy
from minivllm.layers.linear import LinearBase
from minivllm.layers.moe import FusedMoE
from minivllm.models.qwen3 import Qwen3ForCausalLM

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels on a GPU, else interpreted on the CPU
FAST_PATHS = (
    "one_row_gemv",
    "norms_in_products",
    "fused_qk_norm_rope",
    "rope_in_decode",
    "triton_activation",
    "fused_moe",
)


def test_make_attention_backend_and_the_graph_hooks():
    backends = {name: make_attention_backend(name) for name in ("torch", "triton", "flash_attn")}
    assert {name: type(b) for name, b in backends.items()} == {
        "torch": TorchAttentionBackend,
        "triton": TritonAttentionBackend,
        "flash_attn": FlashAttentionBackend,
    }
    assert all(isinstance(b, AttentionBackend) and b.name == name for name, b in backends.items())
    hooks = {name: (b.supports_decode_graphs, b.supports_mixed_graphs) for name, b in backends.items()}
    assert hooks == {"torch": (False, False), "triton": (True, True), "flash_attn": (True, False)}
    assert make_attention_backend("triton") == TritonAttentionBackend()  # stateless: any two are the same
    with pytest.raises(ValueError, match="unknown attention backend 'fast'.*torch, triton, flash_attn"):
        make_attention_backend("fast")
    with pytest.raises(TypeError):
        AttentionBackend()  # the interface itself


def test_the_cpu_policy_is_the_reference():
    policy = kernel_policy("cpu", torch.float32)
    assert policy == KernelPolicy() == kernel_policy(torch.device("cpu"), torch.bfloat16, "torch", "torch")
    assert policy.decode == policy.prefill == TorchAttentionBackend()
    assert not any(getattr(policy, name) for name in FAST_PATHS)
    assert kernel_policy("cpu", torch.float32, "triton").prefill.name == "triton"  # prefill defaults to decode's


def test_the_gpu_policy_turns_on_every_fast_path_and_the_fused_write_for_a_cache_of_the_model_dtype():
    "A policy is only the choices: a GPU's is made (and checked) on a CPU."
    policy = kernel_policy("cuda", torch.bfloat16, "triton", "flash_attn")
    assert (policy.decode.name, policy.prefill.name) == ("triton", "flash_attn")
    assert all(getattr(policy, name) for name in FAST_PATHS)
    assert kernel_policy(torch.device("cuda", 1), torch.bfloat16, cache_dtype=torch.bfloat16).fused_qk_norm_rope
    fp8 = kernel_policy("cuda", torch.bfloat16, "triton", cache_dtype=torch.float8_e4m3fn)
    fused_write = ("fused_qk_norm_rope", "rope_in_decode")  # (an 8-bit cache is written by the store, rounded)
    assert not any(getattr(fp8, name) for name in fused_write)
    assert all(getattr(fp8, name) for name in FAST_PATHS if name not in fused_write)
    flash = kernel_policy("cuda", torch.bfloat16, "flash_attn")  # the write inside the decode: Triton's kernel only
    assert flash.fused_qk_norm_rope and not flash.rope_in_decode
    with pytest.raises(AttributeError):
        policy.one_row_gemv = False  # frozen: decided once


def test_one_row_paths_need_the_policy_and_a_step_of_one_token():
    gpu, reference = kernel_policy("cuda", torch.float16), KernelPolicy()
    one, two = torch.zeros(1, 8), torch.zeros(2, 8)
    assert gpu.gemv_row(one) and gpu.norms_row(one)
    assert not gpu.gemv_row(two) and not gpu.norms_row(two)  # float32: no few-row kernel
    assert not reference.gemv_row(one) and not reference.norms_row(one)


def test_a_few_rows_of_16_bits_run_their_norms_inside_the_products_where_a_tile_holds_them(monkeypatch):
    "On where the GPU starts kernels early, unless MINIVLLM_FEW_ROWS=0 (read at import); then 2 to 16 rows that fit."
    from minivllm.layers import kernel_policy as policy_module

    assert policy_module.FEW_ROWS  # on by default
    monkeypatch.setattr(policy_module, "starts_kernels_early", lambda device: False)
    assert not kernel_policy("cuda", torch.bfloat16).few_row_products  # a GPU without early launch: cuBLAS
    monkeypatch.setattr(policy_module, "starts_kernels_early", lambda device: True)
    gpu = kernel_policy("cuda", torch.bfloat16)
    assert gpu.few_row_products and not kernel_policy("cpu", torch.bfloat16).few_row_products
    monkeypatch.setattr(policy_module, "FEW_ROWS", False)  # MINIVLLM_FEW_ROWS=0
    assert not kernel_policy("cuda", torch.bfloat16).few_row_products
    rows = {n: torch.zeros(n, 1024, dtype=torch.bfloat16) for n in (2, 16, 17, 32)}
    assert gpu.norms_row(rows[2]) and gpu.norms_row(rows[16]) and not gpu.norms_row(rows[17])
    assert not gpu.norms_row(rows[32])  # 32 rows: cuBLAS was faster
    assert not gpu.norms_row(torch.zeros(16, 4096, dtype=torch.bfloat16))  # 16 x 4,096 numbers: more than a tile
    assert not dataclasses.replace(gpu, few_row_products=False).norms_row(rows[2])


def small_qwen3(**overrides) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **overrides,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1)
    return model.eval()


def test_apply_policy_reaches_every_module_that_dispatches():
    model = small_qwen3()
    reference = [m.policy for m in model.modules() if isinstance(m, UsesKernelPolicy)]
    assert len(reference) == 2 * 3 and all(p == KernelPolicy() for p in reference)  # attention, MLP, layer
    assert all(a.backend.name == a.prefill_backend.name == "torch" for a in model.modules() if isinstance(a, Attention))
    policy = kernel_policy("cuda", torch.bfloat16, "triton", "flash_attn")
    assert apply_policy(model, policy) is model
    modules = list(model.modules())
    assert all(m.policy is policy for m in modules if isinstance(m, UsesKernelPolicy))
    attns = [m for m in modules if isinstance(m, Attention)]
    assert len(attns) == 2 and all(a.backend is policy.decode and a.prefill_backend is policy.prefill for a in attns)
    assert "backend=triton, prefill_backend=flash_attn" in repr(attns[0])
    heads = [m for m in modules if isinstance(m, (LinearBase, ParallelLMHead))]
    assert len(heads) == 2 * 4 + 1 and all(m.one_row_gemv for m in heads)
    assert all(m.triton_kernel for m in modules if isinstance(m, SiluAndMul))
    experts = apply_policy(FusedMoE(4, 8, 16), policy)
    assert experts.fused_kernel and not apply_policy(experts, KernelPolicy()).fused_kernel


def test_a_new_policy_drops_the_kept_decode_batch():
    layer = Attention(4, 8, 0.3, 2)
    layer.kept.k = torch.zeros(1)
    layer.use_policy(KernelPolicy())
    assert layer.kept.k is None


def with_cache(model: Qwen3ForCausalLM, num_blocks: int, block_size: int) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.k_cache = torch.zeros(num_blocks, block_size, m.num_kv_heads, m.head_dim, device=DEVICE)
            m.v_cache = torch.zeros_like(m.k_cache)


def run_steps(model: Qwen3ForCausalLM, steps, block_size: int = 4) -> list[torch.Tensor]:
    "Each step: (token ids, positions, query lengths, context lengths, block tables); every row's logits."
    outs = []
    with torch.no_grad():
        for ids, positions, q_lens, ctx_lens, tables in steps:
            meta = AttentionMetadata.build(q_lens, ctx_lens, tables, block_size, device=DEVICE)
            outs.append(model.compute_logits(model(ids.to(DEVICE), positions.to(DEVICE), meta)).cpu())
    return outs


def test_the_gpu_policy_gives_the_reference_numbers_through_the_interpreted_kernels(monkeypatch):
    """Every GPU fast path, taken by the GPU's policy (on a CPU, Triton interpreted): a mixed prefill step of two
    sequences, then decode steps of one token (one-row `gemv`, norms in the products, the K/V write in the decode
    kernel) and of both sequences."""
    from minivllm.kernels import rope_decode

    calls = []
    fused = rope_decode.rope_decode_attention
    monkeypatch.setattr(rope_decode, "rope_decode_attention", lambda *a: calls.append(a[0].shape[0]) or fused(*a))
    torch.manual_seed(1)
    tables = [[3, 0], [5, 1]]
    ids = torch.randint(0, 96, (11,))
    steps = [
        (ids[:7], torch.cat([torch.arange(5), torch.arange(2)]), [5, 2], [5, 2], tables),  # two prompts
        (ids[7:8], torch.tensor([5]), [1], [6], tables[:1]),  # one token: the one-row paths
        (ids[8:9], torch.tensor([2]), [1], [3], tables[1:]),
        (ids[9:11], torch.tensor([6, 3]), [1, 1], [7, 4], tables),  # a decode step of both
    ]
    outs = {}
    gpu = kernel_policy("cuda", torch.float32, "triton", "triton")
    for name, policy in [
        ("reference", KernelPolicy()),
        ("gpu", gpu),
        ("gpu, merge in decode", dataclasses.replace(gpu, merge_in_decode=True)),
    ]:
        model = apply_policy(small_qwen3().to(DEVICE), policy)
        with_cache(model, 6, 4)
        outs[name] = run_steps(model, steps), model.model.layers[1].self_attn.attn.k_cache.cpu()
    for name in ("gpu", "gpu, merge in decode"):
        for got, want in zip(outs[name][0], outs["reference"][0]):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(outs[name][1], outs["reference"][1], atol=1e-5, rtol=1e-5)
    assert calls == [1, 1, 1, 1, 2, 2] * 2  # each decode step, in both layers, took the K/V write in the decode kernel


def test_the_merge_inside_the_decode_kernel_is_a_trial_turned_on_by_its_variable(monkeypatch):
    "Off unless MINIVLLM_MERGE_IN_DECODE=1 (read at import), and then only where the K/V write is in the decode kernel."
    from minivllm.layers import kernel_policy as policy_module

    assert not policy_module.MERGE_IN_DECODE and not kernel_policy("cuda", torch.bfloat16, "triton").merge_in_decode
    monkeypatch.setattr(policy_module, "MERGE_IN_DECODE", True)
    assert kernel_policy("cuda", torch.bfloat16, "triton").merge_in_decode
    assert not kernel_policy("cuda", torch.bfloat16, "flash_attn").merge_in_decode
    assert not kernel_policy("cuda", torch.bfloat16, "triton", cache_dtype=torch.float8_e4m3fn).merge_in_decode
    assert not kernel_policy("cpu", torch.float32, "triton").merge_in_decode


def test_the_runner_hands_the_model_its_engine_policy():
    from minivllm import LLM, TINY_MODEL_PATH

    with LLM(TINY_MODEL_PATH, device="cpu", max_model_len=64, cpu_kvcache_space_gib=0.01) as llm:
        runner = llm.llm_engine.executor.runner
        assert runner.policy == KernelPolicy()  # a CPU engine: the reference
        attns = [m for m in runner.model.modules() if isinstance(m, Attention)]
        assert attns and all(a.backend is runner.policy.decode for a in attns)
        assert runner.graphs is None and runner.mixed_graphs is None


MODEL_FILES = sorted((ROOT / "minivllm" / "models").glob("*.py"))


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.name)
def test_models_ask_the_policy_never_the_device(path):
    "No device checks, no backend names, no batch-size conditions in models/: the policy and the layers decide."
    source = path.read_text()
    for pattern in (r"is_cuda", r"\.device\.type", r"backend ==", r"backend !=", r"shape\[0\] == 1"):
        assert not re.search(pattern, source), f"{path.name}: {pattern}"


def test_building_backends_and_policies_imports_no_kernel():
    "A GPU's policy is made before any kernel runs: no Triton, no flash-attn, no kernel module is imported for it."
    code = textwrap.dedent("""
        import sys, torch
        from minivllm.layers.kernel_policy import kernel_policy
        kernel_policy("cuda", torch.bfloat16, "triton", "flash_attn")
        loaded = [m for m in sys.modules if m.startswith(("triton", "flash_attn", "minivllm.kernels.paged"))]
        assert not loaded, loaded
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr
