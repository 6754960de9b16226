from __future__ import annotations

import itertools
import sys
import time
from enum import Enum, auto

from fastcore.basics import patch

from ..sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()

# %%
class Sequence:
    "One request's tokens and state, cut into logical blocks of `block_size` tokens."
    counter = itertools.count()   # ids for sequences made on their own; an engine numbers its own from 0

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None, block_size: int = 16,
                 seq_id: int | None = None, arrival_time: float | None = None):
        self.seq_id = next(Sequence.counter) if seq_id is None else seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        max_tokens = self.sampling_params.max_tokens   # (a copy: the length at which max_tokens ends it)
        self.max_num_tokens = sys.maxsize if max_tokens is None else self.num_prompt_tokens + max_tokens
        self.block_size = block_size
        self.num_computed_tokens = 0       # leading tokens whose K/V are in the cache
        self.num_cached_tokens = 0         # of those, found in the prefix cache at admission
        self.block_table: list[int] = []   # physical KV blocks holding the tokens, in order
        self.block_hashes: list[int] = []  # chained hashes of its first full blocks (the block manager extends it)
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        self.num_preemptions = 0
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens} "
                f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        "Tokens whose K/V are not in the cache yet: the whole prompt at first, then 1 per decode step."
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

# %%
@patch(as_prop=True)
def num_blocks(self: Sequence) -> int:
    return (len(self.token_ids) + self.block_size - 1) // self.block_size


@patch(as_prop=True)
def num_full_blocks(self: Sequence) -> int:
    return len(self.token_ids) // self.block_size


@patch(as_prop=True)
def last_block_num_tokens(self: Sequence) -> int:
    return len(self.token_ids) - (self.num_blocks - 1) * self.block_size


@patch
def block(self: Sequence, i: int) -> list[int]:
    "The token ids of logical block `i`."
    return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
