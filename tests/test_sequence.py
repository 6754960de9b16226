"""Sequence: token bookkeeping and the block arithmetic every later component relies on."""

import pytest

from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams


def test_new_sequence_state():
    params = SamplingParams(max_tokens=5)
    seq = Sequence([5, 6, 7], params, block_size=4)
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert seq.sampling_params is params
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_completion_tokens) == (3, 3, 0)
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.num_uncomputed_tokens) == (0, 0, 3)
    assert seq.block_table == [] and seq.block_hashes == []
    assert seq.last_token == 7 and len(seq) == 3


def test_ids_are_unique_and_prompt_is_copied():
    prompt = [1, 2]
    a, b = Sequence(prompt), Sequence(prompt)
    assert a.seq_id != b.seq_id
    a.append_token(3)
    assert prompt == [1, 2] and b.token_ids == [1, 2]


@pytest.mark.parametrize(
    "n, bs, blocks, full, last",
    [
        (1, 4, 1, 0, 1),
        (4, 4, 1, 1, 4),
        (5, 4, 2, 1, 1),
        (16, 16, 1, 1, 16),
        (17, 16, 2, 1, 1),
        (50, 16, 4, 3, 2),
    ],
)
def test_block_arithmetic(n, bs, blocks, full, last):
    seq = Sequence(list(range(n)), block_size=bs)
    assert (seq.num_blocks, seq.num_full_blocks, seq.last_block_num_tokens) == (blocks, full, last)
    assert [t for i in range(seq.num_blocks) for t in seq.block(i)] == list(range(n))
    assert all(len(seq.block(i)) == bs for i in range(full))


def test_append_opens_a_block_exactly_when_the_last_is_full():
    seq = Sequence([0, 1, 2], block_size=4)
    opened = []
    for t in range(3, 12):
        before = seq.num_blocks
        seq.append_token(t)
        opened.append(seq.num_blocks > before)
    # tokens 4 and 8 (the 5th and 9th) open blocks 1 and 2
    assert opened == [False, True, False, False, False, True, False, False, False]
    assert seq.completion_token_ids == list(range(3, 12)) and seq.prompt_token_ids == [0, 1, 2]


def test_seq_id_and_arrival_time_can_be_given():
    seq = Sequence([1, 2], seq_id=7, arrival_time=1.5)
    assert (seq.seq_id, seq.arrival_time) == (7, 1.5)
    assert Sequence([1], seq_id=0).seq_id == 0  # an engine numbers its sequences from 0
    assert Sequence([1]).arrival_time is not None


def test_max_num_tokens_follows_max_tokens():
    assert Sequence([1, 2, 3], SamplingParams(max_tokens=4)).max_num_tokens == 7
    assert Sequence([1, 2, 3], SamplingParams(max_tokens=None)).max_num_tokens > 10**9
