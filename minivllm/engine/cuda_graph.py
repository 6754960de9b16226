from __future__ import annotations

import torch

from ..kernels.cascade import use_cascade
from ..layers.attention import AttentionMetadata
from .step_inputs import DeviceStep, StepInputs, StepSizes, numpy_views, step_nbytes, tensor_views


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    return [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16)) + [max_batch_size]


class GraphInputs:
    "What every graph reads: a device buffer laid out as the largest step, and two pinned host mirrors used in turn."

    def __init__(self, max_batch_size: int, max_blocks: int, device: torch.device):
        self.capacity = StepSizes(max_batch_size, max_batch_size, max_batch_size, max_blocks)
        nbytes, pin = step_nbytes(self.capacity), device.type == "cuda"   # (a host-only runner cannot pin)
        self.device_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.hosts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.host_views = [numpy_views(host.numpy(), self.capacity) for host in self.hosts]
        self.views, self.turn = tensor_views(self.device_buffer, self.capacity), 0

    def step(self, bs: int, max_seqlen_k: int, cascade: bool) -> DeviceStep:
        "The first `bs` rows of the buffer as a decode step's device inputs: what a graph is recorded with."
        v = self.views
        meta = AttentionMetadata(v["cu_seqlens_q"][:bs + 1], v["cu_seqlens_k"][:bs + 1], 1, max_seqlen_k,
                                 v["slot_mapping"][:bs], v["context_lens"][:bs], v["block_tables"][:bs],
                                 v["shared_prefix_len"] if cascade else None)
        return DeviceStep(v["input_ids"][:bs], v["positions"][:bs], v["logits_indices"][:bs], meta)

    def load(self, step: StepInputs, batch_size: int, input_ids: torch.Tensor | None) -> None:
        "Fill the buffer with `step`, padded to `batch_size` rows that write nothing (slot -1) and read nothing."
        n, views, host = step.sizes.num_seqs, self.host_views[self.turn], self.hosts[self.turn]
        self.turn ^= 1
        step.write(views)
        views["slot_mapping"][n:batch_size], views["context_lens"][n:batch_size] = -1, 0
        self.device_buffer.copy_(host, non_blocking=True)
        if input_ids is not None:   # the tokens of the step before, still on the device (asynchronous scheduling)
            self.views["input_ids"][:n].copy_(input_ids)

# %%
class CUDAGraphRunner:
    "Decode steps recorded once per batch size (and cascade): a replay launches their hundreds of kernels at once."

    def __init__(self, model: torch.nn.Module, max_batch_size: int, max_model_len: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, cascade: bool = False):
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.inputs = GraphInputs(max_batch_size, -(-max_model_len // block_size), device)
        self.hidden = torch.zeros(max_batch_size, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}   # only batch sizes where a cascade can pay
        self.capture(model, cascade)

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module, cascade: bool) -> None:
        pool = None
        self.inputs.device_buffer.copy_(self.inputs.hosts[0])
        for bs in reversed(self.batch_sizes):
            variants = [(self.graphs, False)]
            if cascade and use_cascade(bs, self.max_model_len):
                variants.append((self.cascade_graphs, True))
            for graphs, shared in variants:
                x = self.inputs.step(bs, self.max_model_len, shared)
                self.hidden[:bs] = model(x.input_ids, x.positions, x.meta)  # warm-up: compile kernels, allocate
                graphs[bs] = graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.hidden[:bs] = model(x.input_ids, x.positions, x.meta)
                pool = pool or graph.pool()
                torch.cuda.synchronize()

    def can_run(self, step: StepInputs) -> bool:
        return step.is_decode_only and step.sizes.num_seqs <= self.max_batch_size

    def replay(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        "Each sequence's hidden state, from the smallest graph that fits; `input_ids`: on the device, for `step`'s."
        n = step.sizes.num_seqs
        bs = next(b for b in self.batch_sizes if b >= n)
        self.inputs.load(step, bs, input_ids)
        (self.cascade_graphs if step.shared_prefix_len[0] else self.graphs)[bs].replay()
        return self.hidden[:n]
