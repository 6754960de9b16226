"""Rank of tests/test_tensor_parallel.py::test_ranks_agree_on_the_smallest_kv_cache (not collected: leading underscore).

Each rank joins a 2-process gloo group, builds a `ModelRunner` whose own CPU budget for the KV cache is `budgets[rank]`,
and reports the number of blocks it sized its cache for. Both ranks start at once (their imports overlap); rank 1 waits
on `ports` for the port of the store rank 0 serves.
"""
from __future__ import annotations


def run(rank: int, ports, budgets: list[float], results) -> None:
    import torch
    import torch.distributed as dist

    from minivllm import TINY_MODEL_PATH
    from minivllm.config import Config
    from minivllm.distributed.launch import join_group, leave_group, master_store
    from minivllm.engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    if rank == 0:
        store = master_store(2)
        ports.put(store.port)
        results.put(("port", store.port))
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=120), 2, is_master=False)
    tp = join_group(rank, 2, torch.device("cpu"), store)
    config = Config(TINY_MODEL_PATH, tensor_parallel_size=2, device="cpu", max_model_len=256, max_num_seqs=256,
                    cpu_kvcache_space_gib=budgets[rank])
    runner = ModelRunner(config, rank, tp)
    results.put((rank, runner.num_blocks))
    runner.close()
    leave_group(tp)
