from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    "A model's tensor-parallel group, explicit (engines may share a process); without groups: which slice to build."
    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None    # the model's collectives: NCCL between GPUs, gloo between CPUs
    control_group: dist.ProcessGroup | None = None   # the steps' host arrays, from rank 0 to the others (gloo)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank must be in [0, size) and size >= 1, got rank {self.rank} of "
                             f"size {self.size}")


SINGLE = TPGroup()   # one process holds the whole model


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator

# %%
def all_reduce(x: torch.Tensor, tp: TPGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.size > 1:
        dist.all_reduce(x, op=op, group=tp.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.device_group)
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size > 1:
        dist.broadcast(x, group=tp.device_group, group_src=0)
    return x
