"""Rank of tests/test_tensor_parallel.py::test_ranks_agree_on_the_smallest_kv_cache (not collected: leading underscore).

Run on both processes of the session's shared pair (tests/_rank_pool.py). Each rank joins a 2-process gloo group,
builds a `ModelRunner` whose own CPU budget for the KV cache is `budgets[rank]`, and returns the number of blocks it
sized its cache for. Rank 0 serves the group's store (`master_store`, on a port the OS picks) and passes its port to
rank 1 through the pool's shared queue.
"""

from __future__ import annotations


def run(rank: int, budgets: list[float]) -> int:
    import _rank_pool
    import torch
    import torch.distributed as dist

    from minivllm import TINY_MODEL_PATH
    from minivllm.distributed.launch import join_group, leave_group, master_store
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.engine_args import EngineArgs

    if rank == 0:
        store = master_store(2)
        _rank_pool.exchange.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", _rank_pool.exchange.get(timeout=120), 2, is_master=False)
    tp = join_group(rank, 2, torch.device("cpu"), store)
    try:
        config = EngineArgs(
            TINY_MODEL_PATH,
            tensor_parallel_size=2,
            device="cpu",
            max_model_len=256,
            max_num_seqs=256,
            cpu_kvcache_space_gib=budgets[rank],
        ).resolve()
        runner = ModelRunner(config, rank, tp)
        blocks = runner.num_blocks
        runner.close()
    finally:
        leave_group(tp)
    return blocks
