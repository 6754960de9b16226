"""Rank of tests/test_tensor_parallel.py::test_ranks_agree_on_the_smallest_kv_cache (not collected: leading underscore).

Each rank joins a 2-process gloo group, builds a `ShardRunner` whose own CPU budget for the KV cache is `budgets[rank]`,
and reports the number of blocks it sized its cache for.
"""
from __future__ import annotations


def run(rank: int, port: int, budgets: list[float], results) -> None:
    import torch
    import torch.distributed as dist

    from minivllm import TINY_MODEL_PATH
    from minivllm.config import Config
    from minivllm.distributed.group import TPGroup
    from minivllm.distributed.launch import master_store
    from minivllm.distributed.worker import ShardRunner

    torch.set_num_threads(1)
    store = master_store(2) if rank == 0 else dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    if rank == 0:
        results.put(("port", store.port))
    group = TPGroup.create("gloo", rank, 2, torch.device("cpu"), store)
    config = Config(TINY_MODEL_PATH, tensor_parallel_size=2, device="cpu", max_model_len=256, max_num_seqs=256,
                    cpu_kvcache_space_gib=budgets[rank])
    with group.active():
        runner = ShardRunner(config, rank)
        results.put((rank, runner.num_blocks))
        runner.close()
    group.destroy()
