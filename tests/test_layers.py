"""The layers of minivllm/layers (notebook 04), each checked against its Hugging Face Qwen3 twin, plus the
tensor-parallel shard arithmetic (ranks built explicitly in one process with `tp=TPGroup(rank, size)`, and a real
2-process gloo group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _net import free_port
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from minivllm.distributed.parallel_state import SINGLE, TPGroup, all_gather_last_dim, all_reduce, broadcast, divide
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    cpu_packing_works,
    pack_for_cpu,
)
from minivllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters


def small_config(**overrides) -> Qwen3Config:
    kw = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def randomize(module: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(1)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module.eval()


def one_process_rank(rank: int, size: int) -> TPGroup:
    """Rank `rank` of a group of `size`, for a forward pass in this single process: its collectives go to a group of
    one member (this process), where an all-reduce returns this rank's partial result unchanged. The test adds the
    ranks' partial results by hand."""
    lone = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    return TPGroup(rank, size, device_group=lone, control_group=lone)


# ---------------------------------------------------------------- parallel_state


def test_parallel_state_without_process_group():
    assert (SINGLE.rank, SINGLE.size) == (0, 1) and SINGLE == TPGroup()
    assert SINGLE.device_group is None and SINGLE.control_group is None
    tp = TPGroup(1, 2)
    assert (tp.rank, tp.size) == (1, 2)
    with pytest.raises(AttributeError):
        tp.rank = 0  # frozen: a layer's group cannot change under it
    x = torch.randn(3, 4)
    assert all_reduce(x, SINGLE) is x and all_gather_last_dim(x, SINGLE) is x and broadcast(x, SINGLE) is x
    assert divide(12, 4) == 3


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0)])
def test_tp_group_rejects_bad_rank(rank, size):
    with pytest.raises(ValueError, match="tensor-parallel rank"):
        TPGroup(rank, size)


def test_divide_names_what_does_not_divide():
    with pytest.raises(ValueError, match=r"num_attention_heads \(10\) must be divisible .* \(4\)"):
        divide(10, 4, "num_attention_heads")


# ---------------------------------------------------------------- RMSNorm, SiluAndMul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48), (3, 4, 48)])
def test_rmsnorm_is_bit_identical_to_qwen3_rmsnorm(dtype, shape):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(48, eps=1e-6), Qwen3RMSNorm(48, eps=1e-6)
    theirs.weight.data.normal_(1.0, 0.2)
    ours.weight.data.copy_(theirs.weight.data)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    out = ours(x)
    assert out.dtype == dtype
    assert torch.equal(out, theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fused_residual(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    theirs = Qwen3RMSNorm(32, eps=1e-5).to(dtype)
    theirs.weight.data.copy_(norm.weight.data)
    x, residual = torch.randn(6, 32).to(dtype), torch.randn(6, 32).to(dtype)
    normed, new_residual = norm(x, residual)
    assert torch.equal(new_residual, residual + x)  # the decoder layer's `hidden = residual + hidden`, same rounding
    assert torch.equal(normed, theirs(residual + x))


def test_rmsnorm_eps_matters_for_tiny_rows():
    x = torch.full((1, 4), 1e-4)
    torch.testing.assert_close(RMSNorm(4, eps=0.0)(x), torch.ones(1, 4))
    expected = x / torch.sqrt(torch.tensor(1e-8 + 1e-6))
    torch.testing.assert_close(RMSNorm(4, eps=1e-6)(x), expected)


def test_silu_and_mul_matches_qwen3_mlp_activation():
    torch.manual_seed(0)
    x = torch.randn(5, 2 * 80)
    gate, up = x[:, :80], x[:, 80:]
    assert torch.equal(SiluAndMul()(x), ACT2FN["silu"](gate) * up)
    assert SiluAndMul()(torch.randn(2, 3, 8)).shape == (2, 3, 4)
    with pytest.raises(ValueError, match="even last dimension"):
        SiluAndMul()(torch.randn(2, 7))


# ---------------------------------------------------------------- rotary embedding


def hf_rope(config, positions, q, k):
    "Hugging Face's rotation of q [N, heads, D] and k [N, kv_heads, D] at `positions` [N]."
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return hq[0].transpose(0, 1), hk[0].transpose(0, 1)


@pytest.mark.parametrize("theta, head_dim", [(10_000.0, 16), (1_000_000.0, 64), (1_000_000.0, 128)])
def test_rope_is_identical_to_hf_qwen3(theta, head_dim):
    config = small_config(
        head_dim=head_dim, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": theta}
    )
    torch.manual_seed(0)
    positions = torch.cat([torch.arange(7), torch.arange(3), torch.randint(0, 4096, (6,)), torch.tensor([4095])])
    q, k = torch.randn(len(positions), 4, head_dim), torch.randn(len(positions), 2, head_dim)
    rope = RotaryEmbedding(head_dim, head_dim, 4096, theta)
    q_rot, k_rot = rope(positions, q, k)
    hq, hk = hf_rope(config, positions, q, k)
    assert torch.equal(q_rot, hq) and torch.equal(k_rot, hk)
    # the flattened layout [N, heads * D] gives the same numbers, in the same shape it came in
    q_flat, k_flat = rope(positions, q.flatten(1), k.flatten(1))
    assert q_flat.shape == (len(positions), 4 * head_dim)
    assert torch.equal(q_flat.view_as(q), q_rot) and torch.equal(k_flat.view_as(k), k_rot)


def test_rope_position_zero_is_identity_and_inputs_are_untouched():
    rope = RotaryEmbedding(16, 16, 32, 10_000.0)
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    q0, k0 = q.clone(), k.clone()
    q_rot, k_rot = rope(torch.zeros(3, dtype=torch.long), q, k)
    assert torch.equal(q_rot, q) and torch.equal(k_rot, k)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, 32, 2048, 10_000.0)
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)

    def score(m, n):
        return (rope(torch.tensor([m]), q, q)[0] * rope(torch.tensor([n]), k, k)[1]).sum()

    torch.testing.assert_close(score(7, 3), score(1007, 1003), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(score(0, 0), (q * k).sum())


def test_partial_rotary_leaves_the_tail_alone():
    torch.manual_seed(0)
    rope, full = RotaryEmbedding(16, 8, 64, 10_000.0), RotaryEmbedding(8, 8, 64, 10_000.0)
    positions = torch.arange(5)
    q, k = torch.randn(5, 3, 16), torch.randn(5, 2, 16)
    q_rot, k_rot = rope(positions, q, k)
    want_q, want_k = full(positions, q[..., :8].contiguous(), k[..., :8].contiguous())
    assert torch.equal(q_rot[..., :8], want_q) and torch.equal(k_rot[..., :8], want_k)
    assert torch.equal(q_rot[..., 8:], q[..., 8:]) and torch.equal(k_rot[..., 8:], k[..., 8:])


def test_rope_keeps_dtype_and_computes_in_float32():
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, 16, 64, 10_000.0)
    positions = torch.arange(4)
    q = torch.randn(4, 2, 16)
    q_bf16, _ = rope(positions, q.bfloat16(), q.bfloat16())
    assert q_bf16.dtype == torch.bfloat16
    assert torch.equal(q_bf16, rope(positions, q.bfloat16().float(), q)[0].bfloat16())
    rope.to(torch.bfloat16)  # a dtype change of the model leaves the angles in float32 (the docstring's float32 cache)
    assert rope.cos_sin_cache.dtype == torch.float32


@pytest.mark.parametrize(
    "bad", [dict(rotary_dim=7), dict(rotary_dim=32), dict(rotary_dim=0), dict(max_position=0), dict(base=0.0)]
)
def test_rope_rejects_bad_arguments(bad):
    kw = dict(head_size=16, rotary_dim=16, max_position=64, base=10_000.0) | bad
    with pytest.raises(ValueError):
        RotaryEmbedding(**kw)


def test_rope_parameters_from_new_and_old_configs():
    assert rope_parameters(small_config()) == (10_000.0, None)
    assert rope_parameters(SimpleNamespace(rope_theta=500_000, rope_scaling=None)) == (500_000.0, None)
    assert rope_parameters(SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "default"})) == (1e6, None)
    yarn = small_config(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 512}
    )
    theta, scaling = rope_parameters(yarn)
    assert theta == 1e6 and scaling["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        get_rope(16, 16, 2048, theta, scaling)
    with pytest.raises(ValueError, match="'linear'"):
        get_rope(16, 16, 2048, 1e4, {"type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="no rope_theta"):
        rope_parameters(SimpleNamespace())


def test_get_rope_makes_a_new_module_each_call():
    "No process-wide sharing: two calls with the same parameters (two models, two engines) hold distinct modules."
    a, b = get_rope(16, 16, 128, 10_000.0), get_rope(16, 16, 128, 10_000, None)
    assert isinstance(a, RotaryEmbedding) and a is not b
    assert a.cos_sin_cache is not b.cos_sin_cache and torch.equal(a.cos_sin_cache, b.cos_sin_cache)
    assert (b.head_size, b.rotary_dim, b.max_position, b.base) == (16, 16, 128, 10_000.0)
    assert isinstance(b.base, float)
    # the cache is this module's buffer, not saved in checkpoints, and it follows the module's .to()
    assert dict(a.named_buffers())["cos_sin_cache"] is a.cos_sin_cache and "cos_sin_cache" not in a.state_dict()
    a.to("meta")
    assert a.cos_sin_cache.device.type == "meta" and b.cos_sin_cache.device.type == "cpu"


# ---------------------------------------------------------------- linear layers vs HF projections


def load_qkv(layer: QKVParallelLinear, attn: Qwen3Attention) -> None:
    for shard_id in "qkv":
        proj = getattr(attn, f"{shard_id}_proj")
        layer.weight.weight_loader(layer.weight, proj.weight, shard_id)
        if proj.bias is not None:
            layer.bias.weight_loader(layer.bias, proj.bias, shard_id)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_qkv_matches_hf_q_k_v_projections(bias):
    config = small_config(attention_bias=bias)
    attn = randomize(Qwen3Attention(config, layer_idx=0))
    qkv = QKVParallelLinear(48, 16, 4, 2, bias=bias)
    load_qkv(qkv, attn)
    x = torch.randn(9, 48)
    q, k, v = qkv(x).split([64, 32, 32], dim=-1)
    with torch.no_grad():
        for ours, proj in [(q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)]:
            torch.testing.assert_close(ours, proj(x), rtol=1e-5, atol=1e-6)


def test_merged_gate_up_and_row_down_match_hf_mlp():
    mlp = randomize(Qwen3MLP(small_config()))
    gate_up, down = MergedColumnParallelLinear(48, [80, 80]), RowParallelLinear(80, 48)
    gate_up.weight.weight_loader(gate_up.weight, mlp.gate_proj.weight, 0)
    gate_up.weight.weight_loader(gate_up.weight, mlp.up_proj.weight, 1)
    down.weight.weight_loader(down.weight, mlp.down_proj.weight)
    x = torch.randn(9, 48)
    with torch.no_grad():
        torch.testing.assert_close(down(SiluAndMul()(gate_up(x))), mlp(x), rtol=1e-5, atol=1e-6)


def test_replicated_linear():
    w, b = torch.randn(6, 4), torch.randn(6)
    layer = ReplicatedLinear(4, 6, bias=True, tp=TPGroup(1, 2))
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


# ---------------------------------------------------------------- tensor-parallel shard arithmetic (explicit ranks)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_column_parallel_ranks_concatenate_to_the_full_output(tp_size):
    torch.manual_seed(0)
    w, b, x = torch.randn(8, 5), torch.randn(8), torch.randn(3, 5)
    outs = []
    for rank in range(tp_size):
        layer = ColumnParallelLinear(5, 8, bias=True, tp=TPGroup(rank, tp_size))
        assert (layer.tp.rank, layer.tp.size) == (rank, tp_size)
        assert layer.weight.shape == (8 // tp_size, 5)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_parallel_partial_sums_add_up_with_the_bias_once(tp_size):
    torch.manual_seed(0)
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    partials = []
    for rank in range(tp_size):
        layer = RowParallelLinear(8, 6, bias=True, tp=one_process_rank(rank, tp_size))
        assert layer.weight.shape == (6, 8 // tp_size) and layer.bias.shape == (6,)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        shard = 8 // tp_size
        partials.append(layer(x[:, rank * shard : (rank + 1) * shard]))  # its all-reduce over one process: a no-op
    torch.testing.assert_close(sum(partials), F.linear(x, w, b))


def test_merged_column_parallel_rank_holds_its_slice_of_each_part():
    gate, up = torch.arange(8 * 3.0).view(8, 3), 100 + torch.arange(8 * 3.0).view(8, 3)
    layer = MergedColumnParallelLinear(3, [8, 8], tp=TPGroup(1, 2))
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    assert torch.equal(layer.weight.data, torch.cat([gate[4:], up[4:]]))


@pytest.mark.parametrize("tp_size, num_heads, num_kv_heads", [(2, 4, 2), (2, 8, 4), (4, 8, 2), (8, 8, 2), (4, 4, 1)])
def test_qkv_parallel_ranks_hold_their_heads(tp_size, num_heads, num_kv_heads):
    torch.manual_seed(0)
    hidden, d = 12, 4
    wq, wk, wv = (
        torch.randn(num_heads * d, hidden),
        torch.randn(num_kv_heads * d, hidden),
        torch.randn(num_kv_heads * d, hidden),
    )
    x = torch.randn(5, hidden)
    full_q, full_k, full_v = (x @ w.T for w in (wq, wk, wv))
    heads_per_rank = num_heads // tp_size
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, d, num_heads, num_kv_heads, tp=TPGroup(rank, tp_size))
        for shard_id, w in zip("qkv", (wq, wk, wv)):
            layer.weight.weight_loader(layer.weight, w, shard_id)
        q, k, v = layer(x).split([layer.num_heads * d, layer.num_kv_heads * d, layer.num_kv_heads * d], dim=-1)
        assert layer.num_heads == heads_per_rank
        torch.testing.assert_close(q, full_q[:, rank * heads_per_rank * d : (rank + 1) * heads_per_rank * d])
        # the KV heads this rank's query heads attend to: query head h uses KV head h // (num_heads / num_kv_heads)
        first_kv = rank * heads_per_rank // (num_heads // num_kv_heads)
        kv_cols = slice(first_kv * d, (first_kv + layer.num_kv_heads) * d)
        torch.testing.assert_close(k, full_k[:, kv_cols])
        torch.testing.assert_close(v, full_v[:, kv_cols])
        if tp_size >= num_kv_heads:
            assert layer.num_kv_heads == 1 and layer.kv_replicas == tp_size // num_kv_heads


def test_qkv_parallel_with_bias_over_two_ranks():
    config = small_config(attention_bias=True)
    attn = randomize(Qwen3Attention(config, layer_idx=0))
    x = torch.randn(4, 48)
    qs, ks = [], []
    for rank in range(2):
        layer = QKVParallelLinear(48, 16, 4, 2, bias=True, tp=TPGroup(rank, 2))
        load_qkv(layer, attn)
        q, k, _ = layer(x).split([32, 16, 16], dim=-1)
        qs.append(q), ks.append(k)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(qs, -1), attn.q_proj(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.cat(ks, -1), attn.k_proj(x), rtol=1e-5, atol=1e-6)


def test_two_rank_mlp_partials_sum_to_hf_mlp():
    mlp = randomize(Qwen3MLP(small_config()))
    x = torch.randn(6, 48)
    partials = []
    for rank in range(2):
        gate_up = MergedColumnParallelLinear(48, [80, 80], tp=TPGroup(rank, 2))
        down = RowParallelLinear(80, 48, tp=one_process_rank(rank, 2))
        gate_up.weight.weight_loader(gate_up.weight, mlp.gate_proj.weight, 0)
        gate_up.weight.weight_loader(gate_up.weight, mlp.up_proj.weight, 1)
        down.weight.weight_loader(down.weight, mlp.down_proj.weight)
        partials.append(down(SiluAndMul()(gate_up(x))))
    with torch.no_grad():
        torch.testing.assert_close(sum(partials), mlp(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- linear layers: bad input


def test_weight_loaders_reject_mis_shaped_tensors_naming_both_shapes():
    qkv = QKVParallelLinear(48, 16, 4, 2, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match=r"expected shape \[32, 48\], found \[32, 47\]"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(32, 47), "k")
    merged = MergedColumnParallelLinear(48, [80, 80])
    with pytest.raises(ValueError, match=r"expected shape \[80, 48\], found \[40, 48\]"):
        merged.weight.weight_loader(merged.weight, torch.randn(40, 48), 1)
    row = RowParallelLinear(80, 48, tp=TPGroup(1, 2))
    with pytest.raises(ValueError, match=r"expected shape \[48, 80\], found \[48, 40\]"):
        row.weight.weight_loader(row.weight, torch.randn(48, 40))
    col = ColumnParallelLinear(48, 80, tp=TPGroup(1, 2))
    with pytest.raises(ValueError, match=r"expected shape \[80, 48\], found \[40, 48\]"):
        col.weight.weight_loader(col.weight, torch.randn(40, 48))
    rep = ReplicatedLinear(4, 6)
    with pytest.raises(ValueError, match=r"expected shape \[6, 4\], found \[4, 6\]"):
        rep.weight.weight_loader(rep.weight, torch.randn(4, 6))


def test_weight_loaders_reject_bad_shard_ids():
    qkv, merged, col = (
        QKVParallelLinear(48, 16, 4, 2),
        MergedColumnParallelLinear(48, [80, 80]),
        ColumnParallelLinear(4, 4),
    )
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(64, 48), "x")
    with pytest.raises(ValueError, match="shard_id must be an index"):
        merged.weight.weight_loader(merged.weight, torch.randn(80, 48), 2)
    with pytest.raises(ValueError, match="no packed shards"):
        col.weight.weight_loader(col.weight, torch.randn(4, 4), 0)


def test_sizes_that_do_not_divide_across_ranks_are_value_errors():
    with pytest.raises(ValueError, match="output_size"):
        ColumnParallelLinear(4, 6, tp=TPGroup(0, 4))
    with pytest.raises(ValueError, match="input_size"):
        RowParallelLinear(6, 4, tp=TPGroup(0, 4))
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(48, 16, 6, 2, tp=TPGroup(0, 4))
    with pytest.raises(ValueError, match="tp_size / num_key_value_heads"):
        QKVParallelLinear(48, 16, 12, 3, tp=TPGroup(0, 4))
    with pytest.raises(ValueError, match="output_sizes"):
        MergedColumnParallelLinear(4, [6, 8], tp=TPGroup(0, 4))


# ---------------------------------------------------------------- embedding and LM head


def test_embedding_and_tied_head_match_torch():
    torch.manual_seed(0)
    table = torch.randn(97, 48)
    embed, head = VocabParallelEmbedding(97, 48), ParallelLMHead(97, 48)
    embed.weight.weight_loader(embed.weight, table)
    head.tie_weights(embed)
    assert head.weight is embed.weight
    ids, h = torch.randint(0, 97, (2, 7)), torch.randn(7, 48)
    assert torch.equal(embed(ids), F.embedding(ids, table))
    assert torch.equal(head(h), F.linear(h, table))


@pytest.mark.parametrize("vocab, tp_size", [(96, 2), (97, 2), (97, 3), (10, 4), (5, 8)])
def test_vocab_parallel_ranks_combine_to_the_full_lookup_and_logits(vocab, tp_size):
    torch.manual_seed(0)
    table, h = torch.randn(vocab, 8), torch.randn(5, 8)
    ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (11,))])
    lookups, logits = [], []
    for rank in range(tp_size):
        embed = VocabParallelEmbedding(vocab, 8, tp=one_process_rank(rank, tp_size))
        head = ParallelLMHead(vocab, 8, tp=TPGroup(rank, tp_size))
        embed.weight.weight_loader(embed.weight, table)
        head.weight.weight_loader(head.weight, table)
        assert embed.weight.shape == (-(-vocab // tp_size), 8)
        lookups.append(embed(ids))
        logits.append(F.linear(h, head.weight))  # this rank's vocabulary slice (its forward all-gathers the slices)
    assert torch.equal(sum(lookups), F.embedding(ids, table))  # each id is found on exactly one rank
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], F.linear(h, table))


def test_embedding_and_head_bad_input():
    embed = VocabParallelEmbedding(97, 48)
    with pytest.raises(ValueError, match=r"expected shape \[97, 48\], found \[96, 48\]"):
        embed.weight.weight_loader(embed.weight, torch.randn(96, 48))
    with pytest.raises(ValueError, match="bias"):
        ParallelLMHead(97, 48, bias=True)
    with pytest.raises(ValueError, match="cannot tie"):
        ParallelLMHead(97, 48).tie_weights(VocabParallelEmbedding(97, 48, tp=TPGroup(0, 2)))


# ---------------------------------------------------------------- a real 2-process group (gloo, CPU)


@pytest.mark.timeout(300)
def test_layers_over_a_real_process_group(rank_pool):
    """Two processes, gloo: the layers built with TPGroup(rank, 2, WORLD, WORLD); their collectives give full results.
    (The processes are the session's shared pair, tests/_rank_pool.py: each rank runs _layers_tp_worker.run.)"""
    assert rank_pool.run("_layers_tp_worker", "run", 2, free_port()) == {0: None, 1: None}


def test_cpu_packing_is_available_on_this_build():
    assert cpu_packing_works()


def test_packed_linear_layers_compute_f_linear():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        [
            ReplicatedLinear(48, 40, bias=True),
            ColumnParallelLinear(48, 64),
            MergedColumnParallelLinear(48, [32, 32]),
            QKVParallelLinear(48, 8, 4, 2),
            RowParallelLinear(64, 48, bias=True),
            ParallelLMHead(100, 48),
        ]
    )
    for p in layers.parameters():
        p.data.normal_()
    inputs = [torch.randn(5, 48)] * 4 + [torch.randn(5, 64), torch.randn(2, 3, 48)]
    with torch.no_grad():
        plain = [layer(x) for layer, x in zip(layers, inputs)]
        assert all(layer.packed_weight is None for layer in layers)
        assert pack_for_cpu(layers) == len(layers)
        assert all(layer.packed_weight is not None for layer in layers)
        for layer, x, expected in zip(layers, inputs, plain):
            assert torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-5), type(layer).__name__
            bias = getattr(layer, "bias", None)
            assert torch.allclose(expected, F.linear(x, layer.weight, bias)[..., : expected.shape[-1]], atol=1e-4)


def test_pack_for_cpu_leaves_other_dtypes_and_reloads_on_a_second_call():
    layer, half = ReplicatedLinear(16, 8), ReplicatedLinear(16, 8).to(torch.bfloat16)
    torch.nn.init.ones_(layer.weight)
    assert pack_for_cpu(torch.nn.ModuleList([layer, half])) == 1 and half.packed_weight is None
    x = torch.randn(3, 16)
    with torch.no_grad():
        layer.weight.weight_loader(layer.weight, torch.full((8, 16), 2.0))
        assert torch.allclose(layer(x), F.linear(x, torch.ones(8, 16)), atol=1e-5)  # the copy does not follow
        pack_for_cpu(layer)
        assert torch.allclose(layer(x), F.linear(x, torch.full((8, 16), 2.0)), atol=1e-5)


def test_linear_uses_the_packed_copy_up_to_256_rows_padded_to_a_power_of_two(monkeypatch):
    from minivllm.layers import linear as linear_module

    w, b = torch.randn(24, 16), torch.randn(24)
    packed, seen = torch.ops.mkldnn._reorder_linear_weight(w, None), []
    real = torch.ops.mkldnn._linear_pointwise

    class Ops:  # records the row counts that reach oneDNN
        @staticmethod
        def _linear_pointwise(x, *args):
            seen.append(x.shape[0])
            return real(x, *args)

    monkeypatch.setattr(linear_module.torch.ops, "mkldnn", Ops)
    for shape in [(1, 16), (5, 16), (2, 3, 16), (256, 16), (257, 16)]:
        x = torch.randn(*shape)
        assert torch.allclose(linear_module.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-5)
    assert seen == [1, 8, 8, 256]  # 257 rows: F.linear
