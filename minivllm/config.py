from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import PretrainedConfig

from .kernels.backends import select_backend
from .models.registry import load_config


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

# %%
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    _check(device in ("cpu", "cuda"), f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    _check(device == "cpu" or torch.cuda.is_available(), "device='cuda' but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str, hf_config: PretrainedConfig) -> torch.dtype:
    "`auto` -> the checkpoint's dtype on a GPU, float32 on a CPU; a dtype the device cannot run is an error."
    auto = dtype == "auto"
    if auto:
        if device == "cpu":
            return torch.float32
        saved = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)).removeprefix("torch.")
        dtype = saved if saved in _DTYPES else "bfloat16"
    _check(dtype in _DTYPES, f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    if device == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        _check(auto, "this GPU cannot run bfloat16: pass dtype='float16' or dtype='float32'")
        dtype = "float16"   # what vLLM does on GPUs older than Ampere
    if device == "cpu":
        try:
            x = torch.ones(2, 2, dtype=_DTYPES[dtype])
            x @ x
        except RuntimeError as e:
            raise ValueError(f"the cpu device cannot run dtype {dtype}: {e}") from None
    return _DTYPES[dtype]

# %%
def check_types(cfg) -> None:
    "TypeErrors for fields of the wrong type (a `max_num_seqs='8'` from a command line, say)."
    if not isinstance(cfg.model, (str, os.PathLike)):
        raise TypeError(f"model must be the path of a Qwen3 checkpoint folder, got {type(cfg.model).__name__}")
    optional = ("max_model_len", "num_kvcache_blocks")
    for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "seed") + optional:
        value = getattr(cfg, name)
        if not (value is None and name in optional) and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    for names, kinds, want in ((("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill",
                                 "skip_tokenizer_init", "async_scheduling"), bool, "True or False"),
                               (("gpu_memory_utilization", "cpu_kvcache_space_gib"), (int, float), "a number"),
                               (("dtype", "device"), str, "a string")):
        for name in names:
            value = getattr(cfg, name)
            if not isinstance(value, kinds) or isinstance(value, bool) and kinds is not bool:   # a bool is no number
                raise TypeError(f"{name} must be {want}, got {value!r}")

# %%
def check_sizes(cfg) -> None:
    hf, limit = cfg.hf_config, cfg.hf_config.max_position_embeddings
    _check(1 <= cfg.max_model_len <= limit,
           f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), got {cfg.max_model_len}")
    _check(cfg.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {cfg.max_num_seqs}")
    _check(cfg.max_num_batched_tokens >= cfg.max_num_seqs,
           f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be at least max_num_seqs "
           f"({cfg.max_num_seqs}): every running sequence needs a token of budget per step")
    _check(cfg.enable_chunked_prefill or cfg.max_num_batched_tokens >= cfg.max_model_len,
           f"without chunked prefill, max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be at least "
           f"max_model_len ({cfg.max_model_len}), or a long prompt could never be scheduled")
    bs = cfg.block_size
    _check(1 <= bs <= 1024 and bs & (bs - 1) == 0, f"block_size must be a power of two in [1, 1024], got {bs}")
    _check(0 < cfg.gpu_memory_utilization <= 1,
           f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    _check(cfg.cpu_kvcache_space_gib > 0, f"cpu_kvcache_space_gib must be > 0, got {cfg.cpu_kvcache_space_gib}")
    _check(cfg.num_kvcache_blocks is None or cfg.num_kvcache_blocks >= 1,
           f"num_kvcache_blocks must be at least 1, got {cfg.num_kvcache_blocks}")
    tp = cfg.tensor_parallel_size
    _check(tp >= 1, f"tensor_parallel_size must be at least 1, got {tp}")
    _check(hf.num_attention_heads % tp == 0 and hf.num_key_value_heads % tp == 0,
           f"tensor_parallel_size {tp} must divide the number of attention heads ({hf.num_attention_heads}) "
           f"and of KV heads ({hf.num_key_value_heads})")
    _check(cfg.device != "cuda" or tp <= torch.cuda.device_count(),
           f"tensor_parallel_size {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")

# %%
@dataclass
class Config:
    "The settings of one engine (vLLM's names), validated when it is made."
    model: str
    tensor_parallel_size: int = 1
    max_model_len: int | None = None            # None: min(4096, the model's max_position_embeddings)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False                 # True: no CUDA graphs
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    block_size: int = 16
    dtype: str = "auto"                         # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"                        # auto: cuda when available, else cpu
    seed: int = 0
    num_kvcache_blocks: int | None = None       # fix the KV-cache size instead of measuring free memory
    cpu_kvcache_space_gib: float = 1.0          # KV-cache memory on a CPU
    attention_backend: str | None = None        # torch | triton | flash_attn; None: chosen once, here
    skip_tokenizer_init: bool = False           # token ids in, token ids out (no text)
    async_scheduling: bool = True               # launch the next decode step before collecting this one
    hf_config: PretrainedConfig | None = field(default=None, repr=False)

    def __post_init__(self):
        check_types(self)
        self.model = os.fspath(self.model) if isinstance(self.model, os.PathLike) else self.model
        self.hf_config = self.hf_config or load_config(self.model)
        self.device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.device, self.hf_config)
        if self.max_model_len is None:
            self.max_model_len = min(4096, self.hf_config.max_position_embeddings)
        check_sizes(self)
        self.attention_backend = select_backend(self.device, self.block_size, self.attention_backend)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> Config:
        known = {f.name for f in fields(cls)} - {"model", "hf_config"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model, **kwargs)

    @property
    def cascade(self) -> bool:
        "Whether decode steps may read a prefix that all their sequences share once (notebook 06: Triton only)."
        return self.enable_prefix_caching and self.attention_backend == "triton"

    @property
    def eos_token_ids(self) -> list[int]:
        "The end-of-sequence ids: generation_config.json's if there is one, else config.json's."
        path = os.path.join(self.model, "generation_config.json")
        ids = json.load(open(path)).get("eos_token_id") if os.path.isfile(path) else None
        ids = self.hf_config.eos_token_id if ids is None else ids
        return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
