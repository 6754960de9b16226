from __future__ import annotations

import torch
from torch import nn

from .fusion import fused_on_gpu


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype, x = x.dtype, x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@fused_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    "`weight * x / rms(x)`, the mean of squares in float32, cast back before the weight (Hugging Face's order)."
    return _rms_norm(x, weight, eps)


@fused_on_gpu
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return _rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    "Root-mean-square norm, computed in float32; `forward(x, residual)` also adds the residual first (fused)."

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size, self.eps, self.weight = hidden_size, eps, nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
