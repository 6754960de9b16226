"""Worker for tests/test_qwen3.py::test_tensor_parallel_model_matches_hf (not collected by pytest: leading underscore).

Each rank of a 2-process gloo group builds the folder's model (Qwen3, or Qwen3-MoE: experts sharded as an MLP) with
`tp=TPGroup(rank, world_size, WORLD, WORLD)`, loads the full checkpoint (each weight_loader cuts this rank's shard),
runs a packed prefill, and checks the logits, which every rank gets whole after the LM head's all-gather, against
transformers on the full model.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run(rank: int, world_size: int, port: int, folders: list[str]) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for folder in folders:
            check_folder(folder, rank, world_size)
    finally:
        dist.destroy_process_group()


def check_folder(folder: str, rank: int, world_size: int) -> None:
    from transformers import AutoModelForCausalLM

    from minivllm.distributed.parallel_state import TPGroup
    from minivllm.layers.attention import AttentionMetadata
    from minivllm.models.registry import build_model, load_config

    config = load_config(folder)
    tp = TPGroup(rank, world_size, dist.group.WORLD, dist.group.WORLD)
    model = build_model(config, folder, torch.float32, torch.device("cpu"), tp)  # the family's class and mapping
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == config.num_attention_heads // world_size
    assert attn.num_kv_heads == max(1, config.num_key_value_heads // world_size)

    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 8]
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lens]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(cu, cu, max(lens), max(lens))
    with torch.no_grad():
        ours = model.compute_logits(model(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), meta))
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        theirs = torch.cat([hf(s[None]).logits[0] for s in seqs])
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert ours.shape == theirs.shape and rel < 1e-4, (folder, rel)
