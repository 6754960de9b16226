from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel_state import SINGLE, TPGroup, all_gather_last_dim, all_reduce
from .linear import check_shape, no_shard_id


class VocabParallelEmbedding(nn.Module):
    "Token embedding with the vocabulary split across ranks: a masked lookup, then an all-reduce."

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp, self.num_embeddings, self.embedding_dim = tp, num_embeddings, embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // tp.size)  # ceil: the last rank may be short
        self.vocab_start_idx = min(tp.rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_idx = min(self.vocab_start_idx + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        no_shard_id(self, shard_id)
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim))
        n = self.vocab_end_idx - self.vocab_start_idx
        param.data[:n].copy_(loaded_weight[self.vocab_start_idx:self.vocab_end_idx])
        param.data[n:].zero_()  # padding rows of the last rank

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start_idx) & (input_ids < self.vocab_end_idx)
        y = F.embedding(mask * (input_ids - self.vocab_start_idx), self.weight) * mask.unsqueeze(-1)
        return all_reduce(y, self.tp)

    def extra_repr(self) -> str:
        tp = f", tokens [{self.vocab_start_idx}, {self.vocab_end_idx}) of rank {self.tp.rank}/{self.tp.size}"
        return f"{self.num_embeddings}, {self.embedding_dim}" + (tp if self.tp.size > 1 else "")

# %%
class ParallelLMHead(VocabParallelEmbedding):
    "Logits for the given hidden rows: this rank's vocabulary slice, then an all-gather of the slices."

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, *, tp: TPGroup = SINGLE):
        if bias:
            raise ValueError("ParallelLMHead does not support a bias")
        super().__init__(num_embeddings, embedding_dim, tp=tp)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"cannot tie an LM head of shape {list(self.weight.shape)} "
                             f"to an embedding of shape {list(embedding.weight.shape)}")
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        "`[num_rows, hidden] -> [num_rows, vocab]` logits (each rank gets all of them)."
        logits = all_gather_last_dim(F.linear(hidden_states, self.weight), self.tp)
        return logits[..., :self.num_embeddings] if logits.shape[-1] > self.num_embeddings else logits
