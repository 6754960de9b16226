"""The fused mixture-of-experts kernel (notebook 06) against its reference loop, transformers' Qwen3-MoE experts and a
dense computation: on the CPU in Triton's interpreter (tiny float32 shapes), on the GPU at Qwen3-30B-A3B's shapes."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.fused_moe import fused_moe, moe_align_block_size, moe_experts_reference

H = 32


def make_weights(E: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w13 [E, 2 * inter, H] and w2 [E, H, inter] in float32 (inter: the intermediate size)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * inter, H, generator=g) * H**-0.5, torch.randn(E, H, inter, generator=g) * inter**-0.5


def random_routing(T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-topk routing over random logits: (topk_weights float32, topk_ids int64)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(T, E, generator=g), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def check_align(topk_ids: torch.Tensor, E: int, block_m: int) -> tuple[int, int]:
    """Assert moe_align_block_size invariants; return (len(sorted_ids), len(expert_ids))."""
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, E, block_m)
    flat = topk_ids.flatten()
    n = flat.numel()
    assert sorted_ids.numel() == n + E * (block_m - 1)
    assert expert_ids.numel() == -(-sorted_ids.numel() // block_m)
    total = int(num_post.item())
    assert num_post.numel() == 1 and total % block_m == 0
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every flat index exactly once
    assert bool((sorted_ids[total:] == n).all())  # past the padded total: sentinel only
    for b in range(total // block_m):
        e = int(expert_ids[b])
        assert 0 <= e < E
        blk = sorted_ids[b * block_m : (b + 1) * block_m].long()
        assert bool((flat[blk[blk < n]] == e).all())  # each block's slots belong to its expert
        assert int((blk < n).sum()) > 0  # no all-padding block inside the total
    assert bool((expert_ids[total // block_m :] >= E).all())
    return sorted_ids.numel(), expert_ids.numel()


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_invariants_and_static_shapes(block_m: int) -> None:
    E = 6
    shapes = {check_align(random_routing(10, E, 2, seed)[1], E, block_m) for seed in range(3)}
    shapes.add(check_align(torch.full((10, 2), 3), E, block_m))  # all slots to one expert
    assert len(shapes) == 1


CASES = [  # (T, E, k, inter, routing)
    (12, 8, 2, 16, "random"),
    (7, 6, 3, 32, "random"),  # E not a power of two
    (1, 8, 2, 16, "random"),  # T=1: most experts never hit
    (9, 5, 1, 16, "random"),  # k=1
    (5, 3, 3, 16, "random"),  # k=E
    (8, 8, 2, 16, "one"),  # every token to the same expert (one slot of each token)
    (6, 7, 2, 16, "few"),  # only experts 0 and 6 hit
    (6, 4, 1, 16, "one"),  # k=1, literally every token to one expert
]


def routing(T: int, E: int, k: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of the given kind: random, all tokens to expert E//2, or only the first/last expert."""
    w, ids = random_routing(T, E, k, seed)
    if kind == "one":
        ids[:, 0] = E // 2
        ids[:, 1:] = (E // 2 + 1 + torch.arange(k - 1)) % E
    elif kind == "few":
        ids = torch.tensor([0, E - 1]).repeat(T, 1)
    return w, ids


@pytest.mark.parametrize("T,E,k,inter,kind", CASES)
def test_fused_moe_matches_reference(T: int, E: int, k: int, inter: int, kind: str) -> None:
    w13, w2 = make_weights(E, inter, seed=T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    w, ids = routing(T, E, k, kind, seed=T + k)
    ref = moe_experts_reference(x, w13, w2, w, ids)
    out = fused_moe(x, w13, w2, w, ids)
    assert out.shape == (T, H) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_fused_moe_block_m_16_with_many_slots_per_expert() -> None:
    E, inter, T, k = 2, 16, 12, 2  # 12 slots per expert: spans partial tiles and padding
    w13, w2 = make_weights(E, inter)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    w, ids = random_routing(T, E, k, seed=3)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)  # several N and K tiles
    ref = moe_experts_reference(x, w13, w2, w, ids)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, w, ids, config=cfg), ref, rtol=0, atol=1e-5 * ref.abs().max().item()
    )


def test_reference_matches_dense() -> None:
    T, E, k, inter = 10, 5, 2, 16
    w13, w2 = make_weights(E, inter, seed=4)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    w, ids = random_routing(T, E, k, seed=6)
    gate, up = torch.einsum("th,eih->eti", x, w13).chunk(2, dim=-1)  # every expert on every token
    dense = torch.einsum("eti,ehi->eth", torch.nn.functional.silu(gate) * up, w2)  # [E, T, H]
    mask = (torch.nn.functional.one_hot(ids, E).float() * w[..., None]).sum(1)  # [T, E]
    expected = torch.einsum("te,eth->th", mask, dense)
    torch.testing.assert_close(moe_experts_reference(x, w13, w2, w, ids), expected, rtol=1e-5, atol=1e-6)


def test_matches_transformers_qwen3_moe_experts() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, inter, T, k = 6, 16, 9, 2
    cfg = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=k, hidden_act="silu"
    )
    cfg._experts_implementation = "eager"
    experts = Qwen3MoeExperts(cfg)
    w13, w2 = make_weights(E, inter, seed=7)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(8))
        w, ids = random_routing(T, E, k, seed=9)
        hf = experts(x, ids, w)
    torch.testing.assert_close(moe_experts_reference(x, w13, w2, w, ids), hf, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_moe(x, w13, w2, w, ids), hf, rtol=0, atol=1e-5 * hf.abs().max().item())


def test_wrong_shape_raises_value_error() -> None:
    w13, w2 = make_weights(4, 16)
    w, ids = random_routing(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"w2 \[4, 32, 8\]"):
        fused_moe(torch.randn(3, H), w13, w2[..., :8], w, ids)
    with pytest.raises(ValueError, match=r"x \[3, 16\]"):
        fused_moe(torch.randn(3, 16), w13, w2, w, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_gpu_fused_moe_at_qwen3_30b_a3b_shapes(tokens: int) -> None:
    "bfloat16 on the GPU, 128 experts of 2048 x 768, 8 per token: within bfloat16 rounding of the float32 loop."
    g = torch.Generator(device="cuda").manual_seed(tokens)
    E, Hd, inter, k = 128, 2048, 768, 8
    x = torch.randn(tokens, Hd, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * inter, Hd, device="cuda", generator=g) * Hd**-0.5).bfloat16()
    w2 = (torch.randn(E, Hd, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    w, ids = torch.randn(tokens, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = moe_experts_reference(x.float(), w13.float(), w2.float(), w, ids)
    out = fused_moe(x, w13, w2, w, ids).float()
    assert (out - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    ref32 = moe_experts_reference(x[:4].float(), w13.float(), w2.float(), w[:4], ids[:4])  # float32: no tf32
    torch.testing.assert_close(
        fused_moe(x[:4].float(), w13.float(), w2.float(), w[:4], ids[:4]), ref32, rtol=1e-4, atol=1e-5
    )
