"""Worker for tests/test_qwen3.py::test_tensor_parallel_model_matches_hf (not collected by pytest: leading underscore).

Each rank of a 2-process gloo group builds Qwen3ForCausalLM (its layers take their rank and size from the process
group), loads the full checkpoint (each weight_loader cuts this rank's shard), runs a packed prefill, and checks the
logits, which every rank gets whole after the LM head's all-gather, against transformers on the full model.
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
            check_folder(folder, world_size)
    finally:
        dist.destroy_process_group()


def check_folder(folder: str, world_size: int) -> None:
    from transformers import AutoModelForCausalLM

    from minivllm.models.qwen3 import Qwen3ForCausalLM
    from minivllm.utils.context import Context, reset_context, set_context
    from minivllm.utils.loader import load_config, load_model

    config = load_config(folder)
    model = load_model(Qwen3ForCausalLM(config), folder).eval()
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == config.num_attention_heads // world_size
    assert attn.num_kv_heads == max(1, config.num_key_value_heads // world_size)

    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 8]
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lens]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    with torch.no_grad():
        set_context(Context(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens)))
        ours = model.compute_logits(model(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens])))
        reset_context()
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        theirs = torch.cat([hf(s[None]).logits[0] for s in seqs])
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert ours.shape == theirs.shape and rel < 1e-4, (folder, rel)
