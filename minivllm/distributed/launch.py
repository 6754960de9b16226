from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .parallel_state import TPGroup

COMM_ENV = {
    "NCCL_NVLS_ENABLE": "0",                    # no NVLink multicast (NVLS) in NCCL's all-reduce
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",    # nor in PyTorch's symmetric memory
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",     # on a NCCL error, abort the communicator but never kill the process
}
IDLE_TIMEOUT = timedelta(days=365)   # ranks wait for the next step as long as the engine lives


def set_comm_env() -> None:
    "Communication settings for this process and the workers it starts (a value already set is kept)."
    for name, value in COMM_ENV.items():
        os.environ.setdefault(name, value)

# %%
@dataclass(frozen=True)
class TorchrunEnv:
    "The place torchrun gave this process: its rank among `world_size`, and its GPU on this host."
    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return TorchrunEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def master_store(world_size: int, timeout: timedelta = timedelta(minutes=5)) -> dist.TCPStore:
    "A key-value store served by this process on a free port (port 0: the OS picks one, so engines never collide)."
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def torchrun_store() -> dist.Store:
    "A client of the store torchrun's agent serves, with keys of minivllm's own (the ranks report failures there)."
    return dist.PrefixStore("minivllm/", dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                       is_master=False, timeout=timedelta(seconds=60)))

# %%
def join_group(rank: int, size: int, device: torch.device, store: dist.Store | None = None) -> TPGroup:
    "Join an engine's group: gloo for the host arrays; between GPUs an NCCL group made now (no half-made communicator)."
    if not dist.is_initialized():
        where = dict(store=store) if store is not None else dict(init_method="env://")
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=IDLE_TIMEOUT, **where)
        control = dist.group.WORLD
    else:   # torchrun, and the script made its own world: a gloo group of our own beside it
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    device_group = dist.new_group(backend="nccl", device_id=device) if device.type == "cuda" else control
    return TPGroup(rank, size, device_group, control)


def leave_group(tp: TPGroup) -> None:
    "Destroy the engine's groups (the default group too, when the engine made it)."
    if tp.control_group is dist.group.WORLD:
        dist.destroy_process_group()
        return
    for group in {tp.device_group, tp.control_group}:
        dist.destroy_process_group(group)
