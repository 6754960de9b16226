from __future__ import annotations

import gc
from dataclasses import dataclass
from functools import partial

import torch
from fastcore.basics import patch

from ..config import Config
from ..distributed.parallel_state import SINGLE, TPGroup, broadcast
from ..layers.sampler import Sampler, SamplingTensors, gather_logprobs
from ..models.registry import build_model
from ..sampling_params import SamplingParams
from .cuda_graph import CUDAGraphRunner
from .kv_cache import allocate_kv_cache, attention_layers, kv_budget, num_kv_blocks
from .sampling_cache import SamplingCache
from .step_inputs import PinnedUploads, StepInputs, to_device


@dataclass
class StepHandle:
    "A step launched on the device and not collected yet: its sampled tokens, still on the device."
    token_ids: torch.Tensor | None = None   # [S] int64; None when the step samples nothing (a prompt chunk)
    logits: torch.Tensor | None = None      # kept when some row asked for logprobs
    sampling: SamplingTensors | None = None

# %%
class ModelRunner:
    "The model, its KV cache and the sampler on one device (one rank): every rank runs `execute`, the first samples."

    def __init__(self, config: Config, rank: int = 0, tp: TPGroup = SINGLE):
        self.config, self.rank, self.tp = config, rank, tp
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.kv_cache = self.graphs = None
        self.model = build_model(config.hf_config, config.model, config.torch_dtype, self.device, tp)
        try:   # a failure from here on (a cache too small, out of memory) must not keep the weights alive
            for layer in attention_layers(self.model):
                layer.backend = config.attention_backend
            self.sampler, self.sampling = Sampler(), SamplingCache(self.device, config.seed)
            self.num_blocks = num_kv_blocks(config, kv_budget(self.model, config, self.device, tp))
            self.kv_cache = allocate_kv_cache(self.model, self.num_blocks, config.block_size, config.torch_dtype,
                                              self.device)
            self.upload = PinnedUploads(self.device) if self.device.type == "cuda" else partial(to_device, device=self.device)
            self.last_sampled: torch.Tensor | None = None   # the token ids of the step before, on the device
            if self.device.type == "cuda" and not config.enforce_eager and config.attention_backend != "torch":
                self.graphs = CUDAGraphRunner(self.model, config.max_num_seqs, config.max_model_len, config.block_size,
                                              config.hf_config.hidden_size, config.torch_dtype, self.device,
                                              cascade=config.cascade)
        except BaseException:
            self.close()
            raise

    def add_request(self, seq_id: int, params: SamplingParams) -> None:
        self.sampling.add(seq_id, params)

    def free_request(self, seq_id: int) -> None:
        self.sampling.free(seq_id)

# %%
@patch
@torch.inference_mode()
def execute(self: ModelRunner, step: StepInputs) -> StepHandle:
    "Queue the forward pass, the sampled rows' logits and (first rank) the sampler, and return at once."
    input_ids = self._ahead_input_ids(step) if step.ahead else None
    if self.graphs is not None and self.graphs.can_run(step):
        hidden, rows = self.graphs.replay(step, input_ids), None   # one row per sequence
    else:
        x = self.upload(step)
        hidden, rows = self.model(x.input_ids if input_ids is None else input_ids, x.positions, x.meta), x.logits_indices
    num_sampled = step.sizes.num_sampled
    if num_sampled == 0:   # a step of prompt chunks only: nothing to sample
        return StepHandle()
    if num_sampled < len(hidden):
        hidden = hidden[rows if rows is not None else torch.from_numpy(step.logits_indices).to(self.device)]
    logits = self.model.compute_logits(hidden)   # every rank: the LM head gathers the vocabulary's slices
    if self.tp.rank != 0:
        return StepHandle()
    sampling, generators = self.sampling.batch(step.seq_ids)
    self.last_sampled = self.sampler(logits, sampling, generators, self.sampling.generator)
    return StepHandle(self.last_sampled, logits if sampling.max_num_logprobs is not None else None, sampling)


@patch
def _ahead_input_ids(self: ModelRunner, step: StepInputs) -> torch.Tensor:
    "The input tokens of a step planned ahead: rows of the step before's samples, which rank 0 holds on the device."
    n = len(step.input_ids)
    if self.tp.rank == 0:
        every_row = n == len(self.last_sampled) and step.input_ids[-1] == n - 1
        ids = self.last_sampled if every_row else self.last_sampled[torch.from_numpy(step.input_ids).to(self.device)]
    else:
        ids = torch.empty(n, dtype=torch.int64, device=self.device)
    return broadcast(ids, self.tp)

# %%
@patch
@torch.inference_mode()
def collect(self: ModelRunner, handle: StepHandle) -> tuple[list[int], list[dict[int, float] | None] | None]:
    if handle.token_ids is None:
        return [], None
    token_ids = handle.token_ids.tolist()   # the host waits here for the device to finish the step
    sampling, logprobs = handle.sampling, None
    if sampling.max_num_logprobs is not None:
        logprobs = gather_logprobs(handle.logits, handle.token_ids,
                                   sampling.max_num_logprobs).tolists(sampling.num_logprobs)
    return token_ids, logprobs


@patch
def synchronize(self: ModelRunner) -> None:
    if self.device.type == "cuda":
        torch.cuda.synchronize(self.device)


@patch
def close(self: ModelRunner) -> None:
    self.graphs = self.kv_cache = self.last_sampled = None
    if getattr(self, "model", None) is not None:
        for layer in attention_layers(self.model):
            layer.k_cache = layer.v_cache = None
    self.model = None
    gc.collect()
    if self.device.type == "cuda":
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
