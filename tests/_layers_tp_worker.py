"""Worker for tests/test_layers.py::test_layers_over_a_real_process_group (not collected by pytest: leading underscore).

Each rank of a real `torch.distributed` gloo group builds the tensor-parallel layers with
`tp=TPGroup(rank, world_size, WORLD, WORLD)` (the groups are explicit), loads the same full weights through the weight
loaders, and checks its output, after the layers' own all-reduce / all-gather, against the full single-process
computation.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def run(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        check_layers(rank, world_size)
    finally:
        dist.destroy_process_group()


def check_layers(rank: int, world_size: int) -> None:
    from minivllm.distributed.parallel_state import TPGroup, all_gather_last_dim, all_reduce, broadcast
    from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
    from minivllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

    tp = TPGroup(rank, world_size, dist.group.WORLD, dist.group.WORLD)
    torch.manual_seed(0)  # the same full weights and inputs on every rank
    hidden, inter, vocab, n = 16, 24, 37, 5  # vocab 37 does not divide by 2: padding on the last rank
    w_gate, w_up, w_down, b_down = (
        torch.randn(inter, hidden),
        torch.randn(inter, hidden),
        torch.randn(hidden, inter),
        torch.randn(hidden),
    )
    emb = torch.randn(vocab, hidden)
    x, ids = torch.randn(n, hidden), torch.randint(0, vocab, (n,))

    t = torch.full((3,), float(rank + 1))
    torch.testing.assert_close(all_reduce(t, tp), torch.full((3,), float(sum(range(1, world_size + 1)))))
    gathered = all_gather_last_dim(torch.full((2, 1), float(rank)), tp)
    torch.testing.assert_close(gathered, torch.arange(world_size, dtype=torch.float).expand(2, -1))
    torch.testing.assert_close(broadcast(torch.full((2,), float(rank + 7)), tp), torch.full((2,), 7.0))

    gate_up = MergedColumnParallelLinear(hidden, [inter, inter], tp=tp)
    assert gate_up.tp is tp
    gate_up.weight.weight_loader(gate_up.weight, w_gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, w_up, 1)
    down = RowParallelLinear(inter, hidden, bias=True, tp=tp)
    down.weight.weight_loader(down.weight, w_down)
    down.bias.weight_loader(down.bias, b_down)
    g, u = gate_up(x).chunk(2, dim=-1)
    want = F.linear(F.silu(x @ w_gate.T) * (x @ w_up.T), w_down, b_down)
    torch.testing.assert_close(down(F.silu(g) * u), want, rtol=1e-5, atol=1e-5)

    col = ColumnParallelLinear(hidden, inter, tp=tp)
    col.weight.weight_loader(col.weight, w_gate)
    torch.testing.assert_close(all_gather_last_dim(col(x), tp), x @ w_gate.T, rtol=1e-5, atol=1e-5)

    embed, head = VocabParallelEmbedding(vocab, hidden, tp=tp), ParallelLMHead(vocab, hidden, tp=tp)
    embed.weight.weight_loader(embed.weight, emb)
    head.tie_weights(embed)
    torch.testing.assert_close(embed(ids), emb[ids])
    torch.testing.assert_close(head(x), x @ emb.T, rtol=1e-5, atol=1e-5)
