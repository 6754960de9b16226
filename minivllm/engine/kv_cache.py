from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import Config
from ..distributed.parallel_state import TPGroup, all_reduce
from ..layers.attention import Attention, AttentionMetadata
from ..layers.sampler import Sampler, SamplingTensors
from ..sampling_params import SamplingParams


def kv_block_bytes(hf_config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = max(1, hf_config.num_key_value_heads // tp_size)
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim * dtype.itemsize


def num_kv_blocks(config: Config, budget_bytes: int) -> int:
    "How many blocks to allocate: what the budget holds, capped at what max_num_seqs sequences could ever use."
    block_bytes = kv_block_bytes(config.hf_config, config.block_size, config.torch_dtype, config.tensor_parallel_size)
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    blocks = config.num_kvcache_blocks or min(budget_bytes // block_bytes, config.max_num_seqs * blocks_per_seq)
    if blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache holds {blocks} blocks of {config.block_size} tokens = {blocks * config.block_size} tokens, "
            f"but one sequence of max_model_len={config.max_model_len} tokens needs {blocks_per_seq} blocks "
            f"({blocks_per_seq * block_bytes / 2**20:.1f} MiB). Give the cache more memory (gpu_memory_utilization, "
            f"cpu_kvcache_space_gib, num_kvcache_blocks) or lower max_model_len.")
    return int(blocks)

# %%
@torch.inference_mode()
def profile_run(model: torch.nn.Module, config: Config, device: torch.device) -> None:
    "Run the largest step the scheduler can make (no cache yet), so the activations' memory peak is recorded."
    seq_len = min(config.max_model_len, config.max_num_batched_tokens)
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // seq_len))
    n = num_seqs * seq_len
    cu = torch.arange(0, n + 1, seq_len, dtype=torch.int32, device=device)
    hidden = model(torch.zeros(n, dtype=torch.int64, device=device), torch.arange(seq_len, device=device).repeat(
        num_seqs), AttentionMetadata(cu, cu, seq_len, seq_len))
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * config.max_num_seqs  # the sort path
    logits = model.compute_logits(hidden[-1:].expand(config.max_num_seqs, -1).contiguous())
    Sampler()(logits, SamplingTensors.from_params(params, device))
    torch.cuda.synchronize(device)


def gpu_kv_budget(utilization: float, device: torch.device) -> int:
    "Bytes the KV cache may take on a GPU: utilization x total, minus what is in use and the measured activation peak."
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    activation_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    return int(total * utilization - (total - free) - activation_peak)


def kv_budget(model: torch.nn.Module, config: Config, device: torch.device, tp: TPGroup) -> int:
    "This engine's KV-cache bytes on every rank: each rank's own budget, then the smallest of them (ranks agree)."
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile_run(model, config, device)
        budget = gpu_kv_budget(config.gpu_memory_utilization, device)
    else:
        budget = int(config.cpu_kvcache_space_gib * 2**30)
    return int(all_reduce(torch.tensor([budget], device=device), tp, dist.ReduceOp.MIN).item())

# %%
def attention_layers(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def allocate_kv_cache(model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    "One tensor for the whole cache; each attention layer gets views of its K and V."
    layers = attention_layers(model)
    shape = (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    make = torch.zeros if device.type == "cuda" else torch.empty  # on a CPU, pages are touched on first write
    kv_cache = make(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
    return kv_cache
