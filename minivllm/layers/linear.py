from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel_state import SINGLE, TPGroup, all_reduce, divide


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"expected shape {list(expected)}, found {list(loaded.shape)}")


def no_shard_id(layer: nn.Module, shard_id) -> None:
    if shard_id is not None:
        raise ValueError(f"{type(layer).__name__} has no packed shards, got shard_id {shard_id!r}")


class LinearBase(nn.Module):
    "`y = x W^T + b` with this rank's `weight` `[output_size, input_size]`; `tp_dim` is the dim cut across ranks."

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.tp, self.tp_dim, self.input_size, self.output_size = tp, tp_dim, input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
                + (f", tp_rank={self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else ""))

# %%
class ReplicatedLinear(LinearBase):
    "The full weight on every rank."

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp: TPGroup = SINGLE):
        super().__init__(input_size, output_size, bias, None, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        no_shard_id(self, shard_id)
        check_shape(loaded_weight, param.shape)
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(LinearBase):
    "Output features split across ranks: rank r holds rows `[r * out / tp, (r + 1) * out / tp)` of the weight."

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp: TPGroup = SINGLE):
        super().__init__(input_size, divide(output_size, tp.size, "output_size"), bias, 0, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        no_shard_id(self, shard_id)
        shard = param.shape[0]
        check_shape(loaded_weight, (shard * self.tp.size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp.rank * shard, shard))

# %%
class MergedColumnParallelLinear(ColumnParallelLinear):
    "Several column-parallel weights (e.g. gate and up) side by side in one matmul; `shard_id` is the part's index."

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *, tp: TPGroup = SINGLE):
        for n in output_sizes:
            divide(n, tp.size, "each of output_sizes")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp=tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index into output_sizes {self.output_sizes}, got {shard_id!r}")
        full = self.output_sizes[shard_id]
        check_shape(loaded_weight, (full, *param.shape[1:]))
        shard, offset = full // self.tp.size, sum(self.output_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, shard).copy_(loaded_weight.narrow(0, self.tp.rank * shard, shard))

# %%
class QKVParallelLinear(ColumnParallelLinear):
    "Q, K and V projections packed into one matmul; heads split across ranks (KV heads replicated if too few)."

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, *, tp: TPGroup = SINGLE):
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp.size, "num_attention_heads")
        if tp.size >= total_num_kv_heads:
            replicas = divide(tp.size, total_num_kv_heads, "tp_size / num_key_value_heads")
            self.num_kv_heads, self.kv_replicas = 1, replicas
        else:
            self.num_kv_heads, self.kv_replicas = divide(total_num_kv_heads, tp.size, "num_key_value_heads"), 1
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_size * tp.size, bias, tp=tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, shard, first_head, total = 0, q, self.tp.rank * self.num_heads, self.total_num_heads
        elif shard_id in ("k", "v"):
            offset, shard = q if shard_id == "k" else q + kv, kv
            first_head, total = self.tp.rank // self.kv_replicas * self.num_kv_heads, self.total_num_kv_heads
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(loaded_weight, (total * self.head_size, *param.shape[1:]))
        param.data.narrow(0, offset, shard).copy_(loaded_weight.narrow(0, first_head * self.head_size, shard))

# %%
class RowParallelLinear(LinearBase):
    "Input features split across ranks; the partial outputs are summed by an all-reduce (bias added once)."

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp: TPGroup = SINGLE):
        super().__init__(divide(input_size, tp.size, "input_size"), output_size, bias, 1, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        no_shard_id(self, shard_id)
        if param.dim() == 1:  # the bias is not split
            check_shape(loaded_weight, param.shape)
            param.data.copy_(loaded_weight)
            return
        shard = param.shape[1]
        check_shape(loaded_weight, (param.shape[0], shard * self.tp.size))
        param.data.copy_(loaded_weight.narrow(1, self.tp.rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None), self.tp)
