from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..layers.attention import AttentionMetadata

# Every array of a step: its name, its type and its length in the step's sizes (T new tokens, S sampled rows,
# B sequences, W the widest block table), in the order they are packed into one buffer.
STEP_FIELDS = (("input_ids", np.int64, "T"), ("positions", np.int64, "T"), ("slot_mapping", np.int64, "T"),
               ("logits_indices", np.int64, "S"), ("seq_ids", np.int64, "S"), ("cu_seqlens_q", np.int32, "B+1"),
               ("cu_seqlens_k", np.int32, "B+1"), ("context_lens", np.int32, "B"), ("block_tables", np.int32, "BxW"),
               ("shared_prefix_len", np.int32, "1"))


@dataclass(frozen=True)
class StepSizes:
    num_tokens: int    # T
    num_sampled: int   # S
    num_seqs: int      # B
    width: int         # W

    def shape(self, size: str) -> tuple[int, ...]:
        t, s, b, w = self.num_tokens, self.num_sampled, self.num_seqs, self.width
        return {"T": (t,), "S": (s,), "B": (b,), "B+1": (b + 1,), "BxW": (b, w), "1": (1,)}[size]


ALIGN = 16   # bytes: Triton compiles a kernel anew for each alignment of its pointers; keep them all 16-aligned


@functools.lru_cache(maxsize=1024)   # (immutable: steps of the same sizes share their layout)
def step_layout(sizes: StepSizes) -> tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]:
    "(name, dtype, shape, byte offset) of each array of a step of these sizes, packed one after the other."
    layout, offset = [], 0
    for name, dtype, size in STEP_FIELDS:
        shape, offset = sizes.shape(size), -(-offset // ALIGN) * ALIGN
        layout.append((name, np.dtype(dtype), shape, offset))
        offset += int(np.prod(shape)) * np.dtype(dtype).itemsize
    return tuple(layout)


def step_nbytes(sizes: StepSizes) -> int:
    name, dtype, shape, offset = step_layout(sizes)[-1]
    return offset + int(np.prod(shape)) * dtype.itemsize

# %%
def numpy_views(buffer: np.ndarray, sizes: StepSizes) -> dict[str, np.ndarray]:
    "The step's arrays as views of a uint8 host buffer laid out for `sizes` (no copies)."
    return {name: buffer[offset:offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
            for name, dtype, shape, offset in step_layout(sizes)}


def tensor_views(buffer: torch.Tensor, sizes: StepSizes) -> dict[str, torch.Tensor]:
    dtypes = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
    return {name: buffer[offset:offset + int(np.prod(shape)) * dtype.itemsize].view(dtypes[dtype]).view(shape)
            for name, dtype, shape, offset in step_layout(sizes)}

# %%
@dataclass
class StepInputs:
    "One step's inputs as host arrays: one schema for its journeys to the device, the graphs' buffers, other ranks."
    input_ids: np.ndarray          # [T] int64 (a step planned ahead: rows of the previous step's sampled tokens)
    positions: np.ndarray          # [T] int64
    slot_mapping: np.ndarray       # [T] int64: cache slot of each new token
    logits_indices: np.ndarray     # [S] int64: the rows whose hidden states become logits
    seq_ids: np.ndarray            # [S] int64: the sequence each sampled row belongs to
    cu_seqlens_q: np.ndarray       # [B+1] int32
    cu_seqlens_k: np.ndarray       # [B+1] int32
    context_lens: np.ndarray       # [B] int32: KV length of each sequence after the step
    block_tables: np.ndarray       # [B, W] int32, padded with -1
    shared_prefix_len: np.ndarray  # [1] int32: a prefix every sequence of a decode step shares, read once (06); or 0
    max_seqlen_q: int
    max_seqlen_k: int
    ahead: bool = False            # planned ahead: `input_ids` are rows of the previous step's samples (10)

    @property
    def sizes(self) -> StepSizes:
        return StepSizes(len(self.input_ids), len(self.seq_ids), len(self.context_lens), self.block_tables.shape[1])

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1

    def write(self, views: dict[str, np.ndarray]) -> None:
        "Copy every array into the front of its view (views of a larger layout leave their tails as they are)."
        for name, _, _ in STEP_FIELDS:
            array = getattr(self, name)
            views[name][tuple(slice(0, n) for n in array.shape)] = array

    def pack(self) -> np.ndarray:
        buffer = np.empty(step_nbytes(self.sizes), dtype=np.uint8)
        self.write(numpy_views(buffer, self.sizes))
        return buffer

    def header(self) -> list[int]:
        "The sizes and scalars: with the packed buffer, all another process needs to have the step again."
        s = self.sizes
        return [s.num_tokens, s.num_sampled, s.num_seqs, s.width, self.max_seqlen_q, self.max_seqlen_k, self.ahead]

    @classmethod
    def unpack(cls, header: list[int], buffer: np.ndarray) -> StepInputs:
        "The step again, from its header and packed buffer; its arrays are views of `buffer`."
        views = numpy_views(buffer, StepSizes(*header[:4]))
        return cls(**views, max_seqlen_q=header[4], max_seqlen_k=header[5], ahead=bool(header[6]))

# %%
@dataclass
class DeviceStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    meta: AttentionMetadata


def device_step(step: StepInputs, t: dict[str, torch.Tensor]) -> DeviceStep:
    cascade = t["shared_prefix_len"] if step.shared_prefix_len[0] else None
    meta = AttentionMetadata(t["cu_seqlens_q"], t["cu_seqlens_k"], step.max_seqlen_q, step.max_seqlen_k,
                             t["slot_mapping"], t["context_lens"], t["block_tables"], cascade)
    return DeviceStep(t["input_ids"], t["positions"], t["logits_indices"], meta)


def to_device(step: StepInputs, device: torch.device) -> DeviceStep:
    "The plain way: on a CPU the arrays as they are; on a GPU one buffer copied over (the host waits for the copy)."
    if device.type == "cpu":
        return device_step(step, {name: torch.from_numpy(getattr(step, name)) for name, _, _ in STEP_FIELDS})
    return device_step(step, tensor_views(torch.from_numpy(step.pack()).to(device), step.sizes))

# %%
class PinnedUploads:
    "The fast way to a GPU: pack into pinned memory (two buffers in turn), whose copy overlaps the step's launch."

    def __init__(self, device: torch.device):
        self.device, self.buffers, self.turn = device, [None, None], 0

    def __call__(self, step: StepInputs) -> DeviceStep:
        sizes = step.sizes
        n, buffer = step_nbytes(sizes), self.buffers[self.turn]
        if buffer is None or buffer.numel() < n:
            buffer = self.buffers[self.turn] = torch.empty(max(n, 1 << 16), dtype=torch.uint8, pin_memory=True)
        self.turn ^= 1
        step.write(numpy_views(buffer.numpy(), sizes))
        return device_step(step, tensor_views(buffer[:n].to(self.device, non_blocking=True), sizes))
