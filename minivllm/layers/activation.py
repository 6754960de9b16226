from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fusion import fused_on_gpu


@fused_on_gpu
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    "`silu(x[..., :d]) * x[..., d:]` for an input whose last dimension is `2 * d` (gate and up, side by side)."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul needs an even last dimension (gate and up), got {x.shape[-1]}")
        return silu_and_mul(x)
