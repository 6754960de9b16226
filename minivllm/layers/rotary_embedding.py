from __future__ import annotations

import torch
from torch import nn

from .fusion import fused_on_gpu


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float) -> torch.Tensor:
    "`[max_position, rotary_dim]` float32: `cos(p * theta_i)` for the rotary_dim/2 pairs, then `sin(p * theta_i)`."
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    "Rotate each pair (x[j], x[j + d/2]) of the last dim by the angle whose cos/sin are given (neox style)."
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@fused_on_gpu
def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    "`apply_rotary` to queries and keys at once (one fused kernel on a GPU)."
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

# %%
class RotaryEmbedding(nn.Module):
    "Neox-style rotary position embedding with a precomputed float32 cos/sin cache."

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float):
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
        if max_position < 1 or base <= 0:
            raise ValueError(f"max_position must be >= 1 and base > 0, got {max_position} and {base}")
        self.head_size, self.rotary_dim, self.max_position, self.base = head_size, rotary_dim, max_position, base
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(rotary_dim, max_position, base), persistent=False)

    def _apply(self, fn, recurse=True):
        "The table moves with the model (`.to(device)`), but stays float32: in bfloat16 the angles would round."
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            cache = rope_cos_sin_cache(self.rotary_dim, self.max_position, self.base)
            self.cos_sin_cache = cache.to(self.cos_sin_cache.device)
        return self

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_size)
        rot = apply_rotary(x[..., :self.rotary_dim], cos, sin)
        if self.rotary_dim < self.head_size:
            rot = torch.cat((rot, x[..., self.rotary_dim:]), dim=-1)
        return rot.reshape(shape)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        "Rotate `q` and `k` (`[num_tokens, heads, head_size]` or `[num_tokens, heads * head_size]`) by `positions`."
        cos, sin = self.cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)   # [tokens, 1, rotary_dim / 2] each
        if self.rotary_dim == self.head_size and q.dim() == k.dim() == 3:   # Qwen3's case: one fused call
            return rotate_qk(q, k, cos, sin)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, base={self.base}"

# %%
def rope_parameters(config) -> tuple[float, dict | None]:
    "`(rope_theta, rope_scaling)` of a Hugging Face config: transformers 5's `rope_parameters` or the older fields."
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = getattr(config, "rope_theta", None), getattr(config, "rope_scaling", None)
    if theta is None:
        raise ValueError("the model config gives no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    return float(theta), None if _rope_type(scaling) == "default" else scaling


def _rope_type(rope_scaling: dict | None) -> str:
    rope_scaling = rope_scaling or {}
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: dict | None = None) -> RotaryEmbedding:
    "A `RotaryEmbedding` for these parameters (a model makes one and its layers share it); unsupported scaling fails."
    kind = _rope_type(rope_scaling)
    if kind != "default":
        raise ValueError(f"rope scaling type {kind!r} is not supported by minivllm (only the default rotary embedding); "
                         f"remove rope_scaling from the model config to run it without context extension")
    return RotaryEmbedding(int(head_size), int(rotary_dim), int(max_position), float(base))
