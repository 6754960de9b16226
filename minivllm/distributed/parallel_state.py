from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a model is sharded over: this process's rank, the group's size, and the process
    groups its collectives go to (explicitly: several engines may live in one process). Without groups, `rank` and
    `size` still say which slice to build (a rank's weights can be made and checked in a single process)."""
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
    "`numerator // denominator`, or a ValueError naming `what` when it does not divide evenly."
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator

# %%
def all_reduce(x: torch.Tensor, tp: TPGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    "Reduce `x` over the group's ranks, in place, and return it (a no-op in a single process)."
    if tp.size > 1:
        dist.all_reduce(x, op=op, group=tp.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    "Concatenate every rank's `x` along the last dimension, in rank order (`x` itself in a single process)."
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.device_group)
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    "Rank 0's `x` on every rank, in place (a no-op in a single process)."
    if tp.size > 1:
        dist.broadcast(x, group=tp.device_group, group_src=0)
    return x
