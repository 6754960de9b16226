from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config

from ..distributed.parallel_state import SINGLE, TPGroup
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention, AttentionMetadata
from ..layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ..layers.layernorm import RMSNorm
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters


class Qwen3Attention(nn.Module):
    "Qwen3 self-attention: packed QKV, RMSNorm on every query/key head, rotary embedding, paged attention, o_proj."

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_emb: RotaryEmbedding,
                 rms_norm_eps: float = 1e-6, qkv_bias: bool = False, *, tp: TPGroup = SINGLE):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # on this rank
        self.head_dim, self.q_size, self.kv_size = head_dim, self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps=rms_norm_eps), RMSNorm(head_dim, eps=rms_norm_eps)
        self.rotary_emb = rotary_emb   # the model's one table of angles, shared by its layers
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=qkv_bias, tp=tp)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta).flatten(1, -1))

# %%
class Qwen3MLP(nn.Module):
    "Qwen3's gated MLP: `down(silu(gate(x)) * up(x))`, with gate and up in one matmul."

    def __init__(self, hidden_size: int, intermediate_size: int, *, tp: TPGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.act_fn, self.down_proj = SiluAndMul(), RowParallelLinear(intermediate_size, hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

# %%
class Qwen3DecoderLayer(nn.Module):
    "One Qwen3 block: attention and MLP, each behind an RMSNorm that also performs the pending residual add."

    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = Qwen3Attention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim(config), rotary_emb,
            config.rms_norm_eps, getattr(config, "attention_bias", False), tp=tp)
        self.mlp = Qwen3MLP(config.hidden_size, config.intermediate_size, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        "Returns `(mlp_output, residual)`: the layer's output is their sum, added by the next norm."
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def head_dim(config: Qwen3Config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

# %%
def check_config(config: Qwen3Config) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
            not layer_types and getattr(config, "use_sliding_window", False)):
        raise ValueError("sliding-window attention (use_sliding_window / layer_types) is not supported by minivllm")
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen3 with hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                         f"num_key_value_heads ({config.num_key_value_heads})")


class Qwen3Model(nn.Module):
    "Embedding, decoder layers, final norm: `[num_tokens]` ids and positions -> `[num_tokens, hidden]`."

    def __init__(self, config: Qwen3Config, tp: TPGroup = SINGLE):
        super().__init__()
        theta, scaling = rope_parameters(config)
        rotary_emb = get_rope(head_dim(config), head_dim(config), config.max_position_embeddings, theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary_emb, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        return self.norm(hidden_states, residual)[0]   # (the norm's second output: the sum before it)

# %%
QWEN3_PACKED_WEIGHTS = {   # checkpoint name part -> (our packed parameter, its shard)
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Qwen3ForCausalLM(nn.Module):
    "Qwen3 for the engine: flat `[num_tokens]` inputs, logits only for the rows asked for, packed and sharded weights."

    def __init__(self, config: Qwen3Config, tp: TPGroup = SINGLE):
        super().__init__()
        check_config(config)
        self.config, self.model = config, Qwen3Model(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        "Hidden states `[num_tokens, hidden]` of the step's flat tokens; without `meta`, the tokens are one sequence."
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        "Logits `[rows, vocab_size]` for the given hidden rows (the runner passes one row per sampled sequence)."
        return self.lm_head(hidden_states)
