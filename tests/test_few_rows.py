"""The few-row products (`minivllm.kernels.few_rows`): a decode step's products at 2 to 32 rows, with the norm before
them and the MLP's activation inside. Against PyTorch in float16 (the interpreter rounds float16
as the GPU does) on the CPU, and in bfloat16 too on a GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from minivllm.kernels.few_rows import (  # noqa: E402
    few_rows_fit,
    few_rows_mm,
    few_rows_tiles,
    norm_few_rows,
    norm_fits,
    norm_product,
)
from minivllm.layers.layernorm import add_rms_norm, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]
SHAPES = [(2, 48, 64), (5, 40, 96), (17, 24, 300), (32, 16, 1100)]  # (rows, N, K): a K loop at 32 rows (512 a tile)


def rnd(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 2e-2 if got.dtype == torch.bfloat16 else 2e-3  # one rounding of the output, and the sum's order
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_few_rows_mm_matches_f_linear(m, n, k, dtype):
    x, w = rnd(m, k, seed=k, dtype=dtype), rnd(n, k, seed=n, scale=k**-0.5, dtype=dtype)
    close(few_rows_mm(x, w), torch.nn.functional.linear(x.float(), w.float()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, k, residual, fuse", [(2, 48, 64, True, False), (7, 40, 96, False, True), (32, 24, 1024, True, True)]
)
def test_norm_few_rows_matches_the_norm_then_the_product(m, n, k, residual, fuse, dtype):
    "rms_norm(x + residual) * w_norm, then F.linear (and the activation: silu(gate) * up), against the one kernel."
    x, res = rnd(m, k, seed=1, dtype=dtype), rnd(m, k, seed=2, dtype=dtype)
    nw, w = 1 + rnd(k, seed=3, scale=0.1, dtype=dtype), rnd(2 * n if fuse else n, k, seed=4, scale=k**-0.5, dtype=dtype)
    normed, total = add_rms_norm(x, res, nw, 1e-6) if residual else (rms_norm(x, nw, 1e-6), x)
    want = torch.nn.functional.linear(normed.float(), w.float())
    want = torch.nn.functional.silu(want[:, :n]) * want[:, n:] if fuse else want
    y, carried = norm_few_rows(x, res if residual else None, nw, 1e-6, w, fuse_silu=fuse)
    close(y, want)
    torch.testing.assert_close(carried, total, atol=0, rtol=0)  # the sum, rounded once as the plain add rounds it
    assert (carried is x) == (not residual)


def test_norm_product_takes_gemv_for_one_row_and_the_few_row_kernel_for_more():
    x, w, nw = rnd(3, 64, seed=5), rnd(40, 64, seed=6, scale=0.125), 1 + rnd(64, seed=7, scale=0.1)
    for rows in (1, 3):
        y, _ = norm_product(x[:rows], None, nw, 1e-6, w, fuse_silu=True)
        want = torch.nn.functional.linear(rms_norm(x[:rows], nw, 1e-6).float(), w.float())
        close(y, torch.nn.functional.silu(want[:, :20]) * want[:, 20:])


def test_the_tiles_fit_a_norm_row_whole_and_the_activation_small():
    assert few_rows_tiles(8, 4096, 1024, norm=True) == (16, 32, 1024, 1, 4)  # Qwen3-0.6B's qkv at batch 8
    assert few_rows_tiles(32, 6144, 1024, norm=True) == (32, 32, 1024, 1, 8)  # gate/up at batch 32: 8 warps
    assert few_rows_tiles(8, 3072, 1024, norm=True, fuse_silu=True)[1] == 32  # gate/up: 32 rows of each, 128 KB
    assert few_rows_tiles(8, 1024, 2048, norm=False) == (16, 16, 1024, 3, 4)  # o: the chain's fastest at 8 rows
    assert norm_fits(16, 2048, torch.bfloat16) and not norm_fits(32, 2048, torch.bfloat16)
    assert not norm_fits(8, 1024, torch.float32) and not norm_fits(33, 64, torch.bfloat16)


def test_few_rows_fit_leaves_one_row_float32_and_a_vocabulary_to_others():
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(96, 64, dtype=torch.bfloat16)
    assert few_rows_fit(x, w) and not few_rows_fit(x[:1], w) and not few_rows_fit(x.float(), w.float())
    assert not few_rows_fit(x, torch.zeros(151936, 64, dtype=torch.bfloat16))  # the LM head: cuBLAS reads it faster
    assert not few_rows_fit(torch.zeros(17, 64, dtype=torch.bfloat16), w)  # more than a step gives them


def test_the_few_row_kernels_refuse_what_they_do_not_compute():
    w = torch.zeros(8, 16, dtype=torch.float16, device=DEVICE)
    for x, weight in [
        (torch.zeros(33, 16, dtype=torch.float16), w),  # too many rows
        (torch.zeros(2, 12, dtype=torch.float16), w),  # K differs
        (torch.zeros(2, 16), w.float()),  # float32
    ]:
        with pytest.raises(ValueError, match="few_rows_mm takes 1 to 32 rows"):
            few_rows_mm(x.to(DEVICE), weight)
    with pytest.raises(ValueError, match="norm_few_rows takes rows whose padded tile holds at most 32768"):
        x, nw, w = (torch.ones(*s, dtype=torch.float16, device=DEVICE) for s in [(32, 2048), (2048,), (8, 2048)])
        norm_few_rows(x, None, nw, 1e-6, w)


NEAR_TIE = 0.1  # nats: bfloat16 keeps 8 bits, so a sum taken in another order moves a logit by about 0.01-0.05


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_engine_gives_the_tokens_of_cublas_with_the_few_row_products(monkeypatch, dtype):
    """The tiny model, 16 prompts (batches of 2 to 16 rows), in CUDA graphs: with the few-row products, and with none.
    float16: the same tokens. bfloat16 rounds 8 times coarser, and the random model's logits have near-ties: where a
    prompt's tokens part, cuBLAS's run must rank the other token second, within NEAR_TIE of its first."""
    from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
    from minivllm.layers import kernel_policy

    prompts = [f"def f{i}(x):\n    return" for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    engine = dict(device="cuda", dtype=dtype, max_model_len=256, gpu_memory_utilization=0.3, max_num_seqs=16)
    runs = {}
    for name, on in [("few rows", True), ("cuBLAS", False)]:
        monkeypatch.setattr(kernel_policy, "FEW_ROWS", on)  # MINIVLLM_FEW_ROWS, as read at import
        with LLM(TINY_MODEL_PATH, **engine) as llm:
            assert llm.llm_engine.executor.runner.model.model.layers[0].policy.few_row_products == on
            runs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    parted = []
    for few, ref in zip(runs["few rows"], runs["cuBLAS"]):
        at = next((i for i, (a, b) in enumerate(zip(few.token_ids, ref.token_ids)) if a != b), None)
        if at is not None:
            top = ref.logprobs[at]
            gap = top[ref.token_ids[at]].logprob - top[few.token_ids[at]].logprob if few.token_ids[at] in top else None
            parted.append((at, gap))
    print(f"{dtype}: {len(prompts) - len(parted)} of {len(prompts)} prompts gave the same tokens; parted at {parted}")
    if dtype == "float16":
        assert not parted, f"prompts parted at (step, cuBLAS's gap in nats): {parted}"
    assert all(gap is not None and gap <= NEAR_TIE for _, gap in parted), f"parted, not at near-ties: {parted}"
