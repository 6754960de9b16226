"""Tests of minivllm.engine.block_manager: block counts, ref counts, prefix cache, free-list order, accounting."""

from __future__ import annotations

from array import array
from collections import Counter

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import minivllm.engine.block_manager as bm_module
from minivllm.engine.block_manager import (
    Block,
    BlockManager,
    FreeBlockQueue,
    PrefixMatch,
    compute_block_hash,
    hash_block_bytes,
)
from minivllm.engine.sequence import Sequence


def seq_of(tokens, block_size=4) -> Sequence:
    return Sequence(list(tokens), block_size=block_size)


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    "'Compute' the next n tokens (blocks allocated), then commit the blocks that filled up, as the scheduler does."
    before = seq.num_computed_tokens
    seq.num_computed_tokens = before + n
    bm.commit(seq, before // bm.block_size)


def run_step(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    "Allocate and 'compute' the next n tokens of a sequence holding blocks (all uncomputed tokens by default)."
    n = seq.num_uncomputed_tokens if n is None else n
    bm.allocate(seq, n)
    compute(bm, seq, n)


def admit(bm: BlockManager, seq: Sequence) -> int:
    "Admit a new sequence (cached prefix first) and compute its whole prompt; returns its cached tokens."
    match = bm.match_prefix(seq)
    n = seq.num_tokens - match.num_tokens
    bm.allocate(seq, n, match)
    compute(bm, seq, n)
    return match.num_tokens


def hits(bm: BlockManager, seq: Sequence) -> int:
    "How many leading full blocks of `seq` the prefix cache holds (what admission would take)."
    return len(bm.match_prefix(seq).block_ids)


def chained_hashes(seq: Sequence, num_blocks: int) -> list[int]:
    """The chained hashes of the first `num_blocks` full blocks, computed here from their definition (xxh64 of the
    previous hash's 8 bytes, if any, and the block's ids as int64), without the block manager's functions."""
    out: list[int] = []
    for i in range(num_blocks):
        prefix = out[-1].to_bytes(8, "little") if out else b""
        out.append(xxhash.xxh64_intdigest(prefix + np.array(seq.block(i), dtype=np.int64).tobytes()))
    return out


def independent_check(bm: BlockManager, seqs) -> None:
    "The invariants, computed here without the code under test."
    free = list(bm.free_blocks)
    assert len(free) == len(set(free)) == bm.num_free_blocks
    holders = Counter(b for s in seqs for b in s.block_table)
    assert not set(holders) & set(free), "a block is both free and in a block table"
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id]
        assert (block.ref_count == 0) == (block.block_id in set(free))
    assert bm.num_free_blocks + sum(1 for b in bm.blocks if b.ref_count > 0) == bm.num_blocks
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h and len(bm.blocks[block_id].token_ids) == bm.block_size


# ---- the hash ---------------------------------------------------------------------------------------------------
def test_compute_block_hash_is_chained_xxh64_of_int64_token_bytes():
    tokens = [5, 6, 7, 8]
    assert compute_block_hash(tokens) == xxhash.xxh64(np.array(tokens, dtype=np.int64).tobytes()).intdigest()
    prev = compute_block_hash([1, 2, 3, 4])
    expected = xxhash.xxh64(prev.to_bytes(8, "little") + np.array(tokens, dtype=np.int64).tobytes()).intdigest()
    assert compute_block_hash(tokens, prev) == expected
    assert compute_block_hash(tokens, prev) != compute_block_hash(tokens, compute_block_hash([9, 9, 9, 9]))


# ---- construction ---------------------------------------------------------------------------------------------
def test_fresh_manager():
    bm = BlockManager(8, block_size=4)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0 and list(bm.free_blocks) == list(range(8))
    assert all(isinstance(b, Block) and b.ref_count == 0 and b.hash == -1 for b in bm.blocks)
    assert BlockManager(3).block_size == 16


# ---- exact block counts -----------------------------------------------------------------------------------------
def test_block_counts_for_prefill_chunks_and_decode():
    bm = BlockManager(16, block_size=4)
    s = seq_of(range(100, 110))  # 10 tokens -> 3 blocks
    m = bm.match_prefix(s)
    assert m == PrefixMatch([], 0)
    assert bm.blocks_needed(s, 10, m) == 3
    assert bm.blocks_needed(s, 3, m) == 1 and bm.blocks_needed(s, 4, m) == 1 and bm.blocks_needed(s, 5, m) == 2
    bm.allocate(s, 5, m)  # a chunk of 5 tokens: 2 blocks
    compute(bm, s, 5)
    assert s.block_table == [0, 1] and bm.num_free_blocks == 14
    assert bm.blocks_needed(s, 3) == 0 and bm.blocks_needed(s, 4) == 1
    run_step(bm, s, 5)
    assert s.block_table == [0, 1, 2] and bm.usage == 3 / 16
    needs = []
    for t in range(6):  # decode: a block when the new token opens one
        s.append_token(t)
        needs.append(bm.blocks_needed(s, 1))
        run_step(bm, s, 1)
    assert needs == [0, 0, 1, 0, 0, 0]  # tokens 11, 12, 13 (new block), 14, 15, 16
    assert len(s.block_table) == 4
    independent_check(bm, [s])


def test_allocate_beyond_free_raises_runtime_error_and_takes_nothing():
    bm = BlockManager(2, block_size=4)
    s = seq_of(range(9))
    m = bm.match_prefix(s)
    assert not bm.can_allocate(s, 9, m) and bm.can_allocate(s, 8, m)
    with pytest.raises(RuntimeError, match="out of KV-cache blocks"):
        bm.allocate(s, 9, m)
    assert s.block_table == [] and bm.num_free_blocks == 2


# ---- the prefix cache -------------------------------------------------------------------------------------------
def test_shared_prefix_hits_ref_counts_and_counters():
    bm = BlockManager(16, block_size=4)
    a = seq_of(range(10))
    admit(bm, a)  # blocks 0, 1 full and cached; block 2 partial
    assert [bm.blocks[b].hash != -1 for b in a.block_table] == [True, True, False]
    assert a.block_hashes == [bm.blocks[0].hash, bm.blocks[1].hash]
    b = seq_of(list(range(9)) + [50, 51, 52])  # shares 9 tokens: 2 full blocks
    m = bm.match_prefix(b)
    assert len(m.block_ids) == 2
    assert bm.blocks_needed(b, 4, m) == 1  # hits on blocks in use cost nothing
    assert m.num_tokens == 8
    bm.allocate(b, 0, m)  # just the cached prefix
    assert b.block_table == [0, 1] and b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    run_step(bm, b)
    assert b.block_table == [0, 1, 3]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 12, 8)
    independent_check(bm, [a, b])


def test_a_hit_never_covers_the_whole_sequence():
    bm = BlockManager(16, block_size=4)
    admit(bm, seq_of(range(12)))  # 3 full blocks cached
    assert hits(bm, seq_of(range(12))) == 2
    assert hits(bm, seq_of(range(13))) == 3
    assert hits(bm, seq_of(range(9))) == 2
    assert hits(bm, seq_of(range(8))) == 1
    one = BlockManager(8, block_size=1)
    admit(one, seq_of([7, 8, 9], block_size=1))
    assert hits(one, seq_of([7, 8, 9], block_size=1)) == 2


def test_registration_happens_at_commit_not_allocation():
    bm = BlockManager(16, block_size=4)
    a = seq_of(range(12))
    m = bm.match_prefix(a)
    bm.allocate(a, 12, m)
    assert len(a.block_hashes) == 2  # hashed at admission (the last block: later)
    assert hits(bm, seq_of(range(13))) == 0  # nothing computed yet
    compute(bm, a, 6)  # only block 0 is full and computed
    assert hits(bm, seq_of(range(13))) == 1 and len(bm.hash_to_block_id) == 1
    compute(bm, a, 6)
    assert hits(bm, seq_of(range(13))) == 3 and len(a.block_hashes) == 3


def test_the_hash_is_chained_a_block_after_a_different_prefix_misses():
    bm = BlockManager(16, block_size=4)
    admit(bm, seq_of([1, 2, 3, 4, 9, 9, 9, 9, 5]))
    assert hits(bm, seq_of([7, 7, 7, 7, 9, 9, 9, 9, 5])) == 0
    assert hits(bm, seq_of([1, 2, 3, 4, 9, 9, 9, 9, 5])) == 2


def test_hash_collision_is_caught_by_the_token_check(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_bytes", lambda data, prefix_hash=-1: 42)
    bm = BlockManager(16, block_size=4)
    a = seq_of([1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.hash_to_block_id == {42: a.block_table[0]}
    b = seq_of([6, 7, 8, 9, 5])  # same (fake) hash, other tokens
    assert hits(bm, b) == 0 and admit(bm, b) == 0
    assert bm.blocks[b.block_table[0]].hash == -1  # the entry stays with the first block
    assert hits(bm, seq_of([1, 2, 3, 4, 0])) == 1
    independent_check(bm, [a, b])


def test_twins_computed_in_the_same_step_share_one_cache_entry():
    bm = BlockManager(16, block_size=4)
    a, b = seq_of(range(9)), seq_of(range(9))
    for s in (a, b):
        bm.allocate(s, 9, bm.match_prefix(s))
    for s in (a, b):
        compute(bm, s, 9)
    assert a.block_hashes == b.block_hashes and len(bm.hash_to_block_id) == 2
    assert [bm.blocks[x].hash != -1 for x in b.block_table] == [False, False, False]
    bm.check_invariants([a, b])
    bm.free(b)
    assert list(bm.free_blocks)[:3] == [3, 4, 5]  # b's uncached blocks go to the front
    bm.free(a)
    independent_check(bm, [])


def test_prefix_caching_off():
    bm = BlockManager(16, block_size=4, enable_prefix_caching=False)
    a, b = seq_of(range(10)), seq_of(range(10))
    assert admit(bm, a) == 0 and admit(bm, b) == 0
    assert bm.hash_to_block_id == {} and a.block_hashes == [] and hits(bm, seq_of(range(10))) == 0
    assert bm.match_prefix(seq_of(range(10))) == PrefixMatch([], 0)
    assert bm.blocks_needed(seq_of(range(10)), 10) == 3
    assert bm.blocks_needed(seq_of(range(10)), 10, bm.match_prefix(seq_of(range(10)))) == 3
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    assert len(set(a.block_table) | set(b.block_table)) == 6


# ---- match_prefix and the sequence's block hashes ------------------------------------------------------------------
def test_match_prefix_reports_blocks_and_tokens_consistently():
    bm = BlockManager(16, block_size=4)
    a = seq_of(range(14))  # 3 full blocks cached after its prompt
    admit(bm, a)
    for n, expect in [(14, 3), (13, 3), (12, 2), (10, 2), (5, 1), (4, 0), (1, 0)]:
        s = seq_of(range(n))
        m = bm.match_prefix(s)
        assert m.block_ids == a.block_table[:expect] and m.num_tokens == 4 * expect
        assert m.num_tokens < s.num_tokens  # the last token is always left to compute
        assert len(s.block_hashes) == (n - 1) // 4
    s = seq_of(list(range(8)) + [99, 99, 99, 99, 1])  # block 2 differs from a's
    m = bm.match_prefix(s)
    assert m.block_ids == a.block_table[:2] and m.num_tokens == 8
    assert s.block_hashes[2] == chained_hashes(s, 3)[2] and s.block_hashes[2] not in bm.hash_to_block_id
    s = seq_of([50] * 9)  # nothing cached: the first block is the first missing
    m = bm.match_prefix(s)
    assert m == PrefixMatch([], 0) and s.block_hashes[0] == chained_hashes(s, 1)[0]


def test_match_prefix_is_read_only():
    bm = BlockManager(8, block_size=4)
    a = seq_of(range(9))
    admit(bm, a)
    bm.free(a)  # blocks 0, 1 free but cached
    state = (
        list(bm.free_blocks),
        [b.ref_count for b in bm.blocks],
        dict(bm.hash_to_block_id),
        bm.prefix_cache_queries,
        bm.prefix_cache_hits,
    )
    s = seq_of(range(12))
    m = bm.match_prefix(s)
    assert m.block_ids == [0, 1] and s.block_table == [] and s.num_computed_tokens == s.num_cached_tokens == 0
    assert bm.match_prefix(s) == m  # asking twice gives the same answer
    assert state == (
        list(bm.free_blocks),
        [b.ref_count for b in bm.blocks],
        dict(bm.hash_to_block_id),
        bm.prefix_cache_queries,
        bm.prefix_cache_hits,
    )


def test_block_hashes_are_computed_once_per_block_and_survive_free(monkeypatch):
    calls = []

    def counting(data, prefix_hash=-1):
        calls.append(list(array("q", data)))
        return hash_block_bytes(data, prefix_hash)

    monkeypatch.setattr(bm_module, "hash_block_bytes", counting)
    bm = BlockManager(16, block_size=4)
    a = seq_of(range(14))
    m = bm.match_prefix(a)  # full blocks before the last token: 3
    assert len(calls) == 3 and a.block_hashes == chained_hashes(a, 3)
    bm.match_prefix(a)
    assert len(calls) == 3  # asked again: nothing recomputed
    bm.allocate(a, 14, m)
    compute(bm, a, 14)
    assert len(calls) == 3  # commit reuses them
    assert a.block_hashes == [bm.blocks[b].hash for b in a.block_table[:3]]
    for t in (20, 21):  # decode to 16 tokens: block 3 fills up
        a.append_token(t)
        run_step(bm, a, 1)
    assert len(calls) == 4 and calls[-1] == a.block(3) and a.block_hashes == chained_hashes(a, 4)
    assert bm.block_hashes(a, 2) is a.block_hashes and len(calls) == 4
    kept = list(a.block_hashes)
    bm.free(a)
    assert a.block_table == [] and a.block_hashes == kept  # free keeps the hashes
    a.num_computed_tokens = 0  # as a preemption does
    a.append_token(22)
    m = bm.match_prefix(a)  # its own blocks, still cached
    assert len(calls) == 4 and m.num_tokens == 16
    assert len(a.block_hashes) == 4  # block 4 is not full: not hashed
    bm.allocate(a, 1, m)
    assert a.block_table[:4] == m.block_ids and a.num_computed_tokens == 16
    compute(bm, a, 1)
    independent_check(bm, [a])


# ---- freeing, reuse order, accounting -----------------------------------------------------------------------------
def test_free_releases_tail_first_and_keeps_cached_contents():
    bm = BlockManager(8, block_size=4)
    a = seq_of(range(14))  # blocks 0, 1, 2 full (cached), 3 partial
    admit(bm, a)
    hashes = list(a.block_hashes)
    bm.free(a)
    assert a.block_table == [] and a.block_hashes == hashes == chained_hashes(a, 3)  # the hashes stay
    # partial block 3 (nothing cached) to the front; cached blocks to the back, tail first: 2, 1, 0
    assert list(bm.free_blocks) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert len(bm.hash_to_block_id) == 3
    independent_check(bm, [])


def test_fresh_blocks_evict_least_recently_freed_cached_blocks_first():
    bm = BlockManager(6, block_size=4)
    a, b = seq_of(range(100, 108)), seq_of(range(200, 208))  # 2 full blocks each, all cached
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_blocks) == [4, 5, 1, 0, 3, 2]
    c = seq_of(range(300, 312))  # 3 fresh blocks: 4, 5, then evicts 1
    assert hits(bm, c) == 0
    admit(bm, c)
    assert c.block_table == [4, 5, 1]
    assert hits(bm, seq_of(range(100, 109))) == 1  # a's first block survived, its second did not
    assert hits(bm, seq_of(range(200, 209))) == 2
    independent_check(bm, [c])


def test_hit_on_free_cached_block_consumes_it_hit_on_used_block_does_not():
    bm = BlockManager(8, block_size=4)
    a, b = seq_of(range(13)), seq_of(list(range(8)) + [90, 91, 92, 93, 94])
    admit(bm, a)  # a: blocks 0, 1, 2 (cached), 3
    admit(bm, b)  # b: shares 0, 1; fresh 4, 5
    bm.free(a)  # 2 is free but cached; 0 and 1 still used by b
    c = seq_of(list(range(13)) + [77])  # hits 0, 1 (in use) and 2 (free, cached)
    m = bm.match_prefix(c)
    assert len(m.block_ids) == 3
    free_before = bm.num_free_blocks
    assert bm.blocks_needed(c, 2, m) == 1 + 1  # block 2 leaves the free list, plus one fresh block
    assert bm.blocks_needed(c, 0, m) == 1 + 0  # just taking the prefix: block 2
    bm.allocate(c, 0, m)
    assert c.block_table == [0, 1, 2] and 2 not in bm.free_blocks
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    bm.allocate(c, 2)
    assert free_before - bm.num_free_blocks == 2
    independent_check(bm, [b, c])


def test_reset_prefix_cache_drops_only_free_blocks():
    bm = BlockManager(8, block_size=4)
    a, b = seq_of(range(9)), seq_of(range(50, 59))
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert hits(bm, seq_of(range(9))) == 0
    assert hits(bm, seq_of(range(50, 59))) == 2  # in use: kept
    assert all(bm.blocks[x].hash == -1 for x in bm.free_blocks)
    independent_check(bm, [b])


def test_check_invariants_reports_corruption():
    bm = BlockManager(4, block_size=4)
    s = seq_of(range(6))
    admit(bm, s)
    bm.check_invariants([s])
    bm.blocks[s.block_table[0]].ref_count = 2
    with pytest.raises(RuntimeError, match="ref_count 2 but 1 block tables"):
        bm.check_invariants([s])
    bm.blocks[s.block_table[0]].ref_count = 0
    with pytest.raises(RuntimeError, match="not in the free list"):
        bm.check_invariants()


def test_free_block_queue_order_and_removal():
    q = FreeBlockQueue(range(4))
    assert [q.pop(), q.pop()] == [0, 1]
    q.push(1, cached=True)
    q.push(0, cached=False)
    assert list(q) == [0, 2, 3, 1] and len(q) == 4 and 1 in q
    q.remove(1)
    assert list(q) == [0, 2, 3] and 1 not in q


# ---- property test: random operations, exact accounting --------------------------------------------------------
@st.composite
def operations(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    num_blocks = draw(st.integers(2, 24))
    prefixes = [draw(st.lists(st.integers(0, 5), min_size=1, max_size=16)) for _ in range(2)]
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["new", "grow", "free", "reset"]),
                st.integers(0, 99),
                st.lists(st.integers(0, 5), max_size=6),
                st.integers(1, 12),
            ),
            max_size=40,
        )
    )
    return block_size, num_blocks, prefixes, ops, draw(st.booleans())


def check_match(bm: BlockManager, s: Sequence, m: PrefixMatch) -> None:
    "A match, checked against the cache's contents: cached ids in order, their tokens, the first block missing."
    bs = bm.block_size
    assert m.num_tokens == len(m.block_ids) * bs < s.num_tokens  # never the last token
    for i, block_id in enumerate(m.block_ids):
        block = bm.blocks[block_id]
        assert bm.hash_to_block_id[block.hash] == block_id and block.token_ids == s.block(i)
        assert block.hash == s.block_hashes[i]
    if not bm.enable_prefix_caching:
        assert m == PrefixMatch([], 0)
        return
    assert s.block_hashes[: (s.num_tokens - 1) // bs] == chained_hashes(s, (s.num_tokens - 1) // bs)
    if len(m.block_ids) < (s.num_tokens - 1) // bs:  # stopped at a miss: the next full block is not cached as it is
        cached = bm.hash_to_block_id.get(s.block_hashes[len(m.block_ids)])
        assert cached is None or bm.blocks[cached].token_ids != s.block(len(m.block_ids))


@settings(max_examples=200, deadline=None)
@given(operations())
def test_random_operations_keep_invariants_and_exact_accounting(case):
    block_size, num_blocks, prefixes, ops, caching = case
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for op, pick, tokens, n in ops:
        if op == "new":
            prefix = prefixes[pick % 2][: pick % 17]
            s = seq_of(prefix + tokens or [1], block_size)
            m = bm.match_prefix(s)
            check_match(bm, s, m)
            chunk = min(n, s.num_tokens - m.num_tokens)
            need, free = bm.blocks_needed(s, chunk, m), bm.num_free_blocks
            if need > free:
                assert not bm.can_allocate(s, chunk, m)
                continue
            bm.allocate(s, chunk, m)
            assert s.num_computed_tokens == s.num_cached_tokens == m.num_tokens
            assert s.block_table[: len(m.block_ids)] == m.block_ids
            assert free - bm.num_free_blocks == need
            compute(bm, s, chunk)
            live.append(s)
        elif op == "grow" and live:
            s = live[pick % len(live)]
            if s.num_uncomputed_tokens == 0:
                s.append_token(pick % 6)
            chunk = min(n, s.num_uncomputed_tokens)
            need, free = bm.blocks_needed(s, chunk), bm.num_free_blocks
            if need > free:
                assert not bm.can_allocate(s, chunk)
                continue
            bm.allocate(s, chunk)
            assert free - bm.num_free_blocks == need
            assert len(s.block_table) * block_size >= s.num_computed_tokens + chunk
            compute(bm, s, chunk)
        elif op == "free" and live:
            bm.free(live.pop(pick % len(live)))
        elif op == "reset":
            bm.reset_prefix_cache()
        independent_check(bm, live)
        bm.check_invariants(live)
        for s in live:  # a cached block's stored tokens are the sequence's tokens there
            assert s.block_hashes == chained_hashes(s, len(s.block_hashes))
            for i, h in enumerate(s.block_hashes[: len(s.block_table)]):
                block = bm.blocks[s.block_table[i]]
                assert block.hash in (-1, h)
                if block.hash == h:
                    assert block.token_ids == s.block(i)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == num_blocks and bm.usage == 0
    independent_check(bm, [])
