from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import xxhash
from fastcore.basics import patch

from .sequence import Sequence

# %%
class Block:
    "One physical KV-cache block: how many sequences use it and, once full and computed, what it holds."
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id, self.ref_count = block_id, 0
        self.hash = -1                    # prefix-cache key while the block holds a registered full block
        self.token_ids: list[int] = []    # the tokens it holds, to confirm a prefix-cache hit

    def __repr__(self) -> str:
        cached = f", cached {self.token_ids}" if self.hash != -1 else ""
        return f"Block({self.block_id}, ref_count={self.ref_count}{cached})"

# %%
class FreeBlockQueue:
    "Free block ids in reuse order: empty blocks first, then cached blocks, least recently freed first."

    def __init__(self, block_ids: Iterable[int] = ()):
        self._ids: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._ids

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __repr__(self) -> str:
        return f"FreeBlockQueue({list(self._ids)})"

    def push(self, block_id: int, cached: bool) -> None:
        "Return a block: a cached one to the back (reused last), an empty one to the front (reusing it costs nothing)."
        self._ids[block_id] = None
        if not cached:
            self._ids.move_to_end(block_id, last=False)

    def pop(self) -> int:
        return self._ids.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        "Take one particular block out, in O(1): a prefix-cache hit on a free block."
        del self._ids[block_id]

# %%
def compute_block_hash(token_ids: list[int], prefix_hash: int = -1) -> int:
    "Chained hash of one full block: xxh64 of the previous block's hash (if any) and the block's token ids."
    prefix = prefix_hash.to_bytes(8, "little") if prefix_hash != -1 else b""
    return xxhash.xxh64_intdigest(prefix + array("q", token_ids).tobytes())   # the ids as int64 bytes

# %%
class BlockManager:
    "Paged KV-cache bookkeeping: a pool of blocks, a free list, ref counts and a prefix cache of full blocks."

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self.blocks, self.free_blocks = [Block(i) for i in range(num_blocks)], FreeBlockQueue(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0     # of those, tokens found there

    def __repr__(self) -> str:
        return (f"BlockManager({self.num_blocks} blocks of {self.block_size}, {self.num_free_blocks} free, "
                f"{len(self.hash_to_block_id)} cached)")

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        "Fraction of the blocks in use by some sequence (free but cached blocks count as free)."
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _uncache(self, block: Block) -> None:
        if block.hash != -1:
            del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = -1, []

# %%
class PrefixMatch(NamedTuple):
    "What the prefix cache holds of a waiting sequence: computed once when it is considered for admission."
    block_ids: list[int]       # the cached blocks of its leading full blocks, in order
    num_tokens: int            # the tokens they hold
    first_missing: int | None  # hash of its first full block the cache lacks (None: none is missing, or no cache)


@patch
def block_hashes(self: BlockManager, seq: Sequence, num_blocks: int) -> list[int]:
    "The chained hashes of the sequence's first `num_blocks` full blocks (computed once each, kept on the sequence)."
    hashes = seq.block_hashes
    for i in range(len(hashes), min(num_blocks, seq.num_full_blocks)):
        hashes.append(compute_block_hash(seq.block(i), hashes[-1] if hashes else -1))
    return hashes


@patch
def match_prefix(self: BlockManager, seq: Sequence) -> PrefixMatch:
    "The sequence's leading full blocks found in the prefix cache, leaving at least one token to compute."
    if not self.enable_prefix_caching:
        return PrefixMatch([], 0, None)
    num_full = (seq.num_tokens - 1) // self.block_size   # the last token is always computed: its logits are needed
    hashes, hits = self.block_hashes(seq, num_full), []
    for i, h in enumerate(hashes[:num_full]):
        block_id = self.hash_to_block_id.get(h)
        if block_id is None or self.blocks[block_id].token_ids != seq.block(i):   # (a hash collision is a miss)
            return PrefixMatch(hits, len(hits) * self.block_size, h)
        hits.append(block_id)
    return PrefixMatch(hits, len(hits) * self.block_size, None)

# %%
@patch
def blocks_needed(self: BlockManager, seq: Sequence, num_new_tokens: int, match: PrefixMatch | None = None) -> int:
    "Free blocks `allocate` takes: for tokens past the computed (or `match`ed) ones, and a match's free cache hits."
    if match is None:   # a running sequence: it holds its blocks
        return max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table))
    free_hits = sum(self.blocks[b].ref_count == 0 for b in match.block_ids)
    return free_hits + -(-(match.num_tokens + num_new_tokens) // self.block_size) - len(match.block_ids)


@patch
def can_allocate(self: BlockManager, seq: Sequence, num_new_tokens: int, match: PrefixMatch | None = None) -> bool:
    return self.blocks_needed(seq, num_new_tokens, match) <= self.num_free_blocks


@patch
def allocate(self: BlockManager, seq: Sequence, num_new_tokens: int, match: PrefixMatch | None = None) -> None:
    "Blocks for `num_new_tokens` more tokens; a waiting sequence first takes its cache hits (`match`) as computed."
    if match is not None:
        for block_id in match.block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_blocks.remove(block_id)
            block.ref_count += 1
        seq.block_table = list(match.block_ids)
        seq.num_computed_tokens = seq.num_cached_tokens = match.num_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += match.num_tokens
    self.reserve(seq, seq.num_computed_tokens + num_new_tokens)


@patch
def reserve(self: BlockManager, seq: Sequence, num_tokens: int) -> None:
    missing = -(-num_tokens // self.block_size) - len(seq.block_table)
    if missing > self.num_free_blocks:
        raise RuntimeError(f"out of KV-cache blocks: sequence {seq.seq_id} needs {missing}, "
                           f"{self.num_free_blocks} are free (check can_allocate first)")
    for _ in range(missing):
        block = self.blocks[self.free_blocks.pop()]
        self._uncache(block)
        block.ref_count = 1
        seq.block_table.append(block.block_id)

# %%
@patch
def commit(self: BlockManager, seq: Sequence, first_block: int) -> None:
    "After a step wrote K/V: register the full computed blocks from `first_block` on in the prefix cache (no twins)."
    if not self.enable_prefix_caching:
        return
    num_full = seq.num_computed_tokens // self.block_size
    for i, h in enumerate(self.block_hashes(seq, num_full)[first_block:num_full], first_block):
        if h not in self.hash_to_block_id:
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, seq.block(i)
            self.hash_to_block_id[h] = block.block_id


@patch
def free(self: BlockManager, seq: Sequence) -> None:
    "Release the sequence's blocks, tail first, so that shared prefixes stay cached the longest."
    for block_id in reversed(seq.block_table):
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.push(block_id, cached=block.hash != -1)
    seq.block_table = []


@patch
def reset_prefix_cache(self: BlockManager) -> int:
    "Forget the contents of every free block (after a fault). Returns how many cache entries were dropped."
    dropped = [b for b in self.free_blocks if self.blocks[b].hash != -1]
    for block_id in dropped:
        self._uncache(self.blocks[block_id])
        self.free_blocks.push(block_id, cached=False)
    return len(dropped)

# %%
@patch
def check_invariants(self: BlockManager, seqs: Iterable[Sequence] | None = None) -> None:
    "Raise RuntimeError if the bookkeeping is inconsistent; with `seqs` (all holders), check the ref counts too."
    problems = []
    for block in self.blocks:
        if block.ref_count < 0 or (block.ref_count == 0) != (block.block_id in self.free_blocks):
            problems.append(f"block {block.block_id} has ref_count {block.ref_count} but is "
                            f"{'' if block.block_id in self.free_blocks else 'not '}in the free list")
        if block.hash != -1 and (self.hash_to_block_id.get(block.hash) != block.block_id
                                 or len(block.token_ids) != self.block_size):
            problems.append(f"block {block.block_id} is cached but not registered as such")
    if len(self.hash_to_block_id) != sum(b.hash != -1 for b in self.blocks):
        problems.append("the prefix cache names blocks that do not hold its entries")
    if seqs is not None:
        holders = Counter(block_id for seq in seqs for block_id in seq.block_table)
        for block in self.blocks:
            if holders[block.block_id] != block.ref_count:
                problems.append(f"block {block.block_id} has ref_count {block.ref_count} but "
                                f"{holders[block.block_id]} block tables hold it")
    if problems:
        raise RuntimeError("block manager invariants broken: " + "; ".join(problems[:5]))
