from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .parallel_state import TPGroup

STOP, STEP = 0, 1
HEADER_WORDS = 9   # command, payload bytes, then the step's own header (7 words)


def send_step(header: list[int], payload: np.ndarray, tp: TPGroup) -> None:
    dist.broadcast(torch.tensor([STEP, len(payload), *header], dtype=torch.int64), group=tp.control_group, group_src=0)
    dist.broadcast(torch.from_numpy(payload), group=tp.control_group, group_src=0)


def send_stop(tp: TPGroup) -> None:
    dist.broadcast(torch.zeros(HEADER_WORDS, dtype=torch.int64), group=tp.control_group, group_src=0)


def recv_step(tp: TPGroup) -> tuple[list[int], np.ndarray] | None:
    "Another rank: wait for rank 0's next step (its header and packed arrays); None when told to stop."
    words = torch.empty(HEADER_WORDS, dtype=torch.int64)
    dist.broadcast(words, group=tp.control_group, group_src=0)
    command, nbytes, *header = words.tolist()
    if command == STOP:
        return None
    payload = torch.empty(nbytes, dtype=torch.uint8)
    dist.broadcast(payload, group=tp.control_group, group_src=0)
    return header, payload.numpy()
