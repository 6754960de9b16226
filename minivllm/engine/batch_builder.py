from __future__ import annotations

import numpy as np

from ..kernels.cascade import cascade_prefix_len
from .scheduler import StepPlan
from .sequence import Sequence
from .step_inputs import StepInputs

NO_PREFIX = np.zeros(1, dtype=np.int32)


def block_table_array(seqs: list[Sequence]) -> np.ndarray:
    width = max((len(s.block_table) for s in seqs), default=0)
    table = np.full((len(seqs), width), -1, dtype=np.int32)
    for row, seq in zip(table, seqs):
        row[:len(seq.block_table)] = seq.block_table
    return table


def cumsum0(lengths: list[int] | np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def seq_ids(seqs: list[Sequence]) -> np.ndarray:
    return np.fromiter((s.seq_id for s in seqs), dtype=np.int64, count=len(seqs))

# %%
def prepare_step(plan: StepPlan, block_size: int) -> StepInputs:
    "The host arrays of any step: sequence i computes its tokens [num_computed, num_computed + n) of the plan."
    ids, positions, slots, logits_indices, kv_lens, offset = [], [], [], [], [], 0
    for seq, n in zip(plan.seqs, plan.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        pos = np.arange(start, end, dtype=np.int64)
        ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
        positions.append(pos)
        slots.append(np.asarray(seq.block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)
        offset += n
        if end == seq.num_tokens:   # the step reaches its end: its last row is sampled
            logits_indices.append(offset - 1)
        kv_lens.append(end)
    return StepInputs(
        input_ids=np.concatenate(ids), positions=np.concatenate(positions), slot_mapping=np.concatenate(slots),
        logits_indices=np.asarray(logits_indices, dtype=np.int64), seq_ids=seq_ids(plan.sampled),
        cu_seqlens_q=cumsum0(plan.num_new_tokens), cu_seqlens_k=cumsum0(kv_lens),
        context_lens=np.asarray(kv_lens, dtype=np.int32), block_tables=block_table_array(plan.seqs),
        shared_prefix_len=NO_PREFIX, max_seqlen_q=max(plan.num_new_tokens), max_seqlen_k=max(kv_lens))

# %%
class BlockTables:
    "Each running sequence's block table as a row of one numpy array, updated only where it grew."

    def __init__(self, max_blocks: int, num_rows: int = 16):
        self.table = np.full((num_rows, max_blocks), -1, dtype=np.int32)
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.rows: dict[int, tuple[int, int, int]] = {}   # seq_id -> (row, entries written, preemptions)

    def array(self, seqs: list[Sequence]) -> np.ndarray:
        rows, width, get = [], 1, self.rows.get
        for seq in seqs:
            row, n = get(seq.seq_id), len(seq.block_table)
            if row is None or row[1] != n or row[2] != seq.num_preemptions:
                row = self._update(seq)
            rows.append(row[0])
            if n > width:
                width = n
        return self.table[np.array(rows), :width]

    def _update(self, seq: Sequence) -> tuple[int, int, int]:
        "Write the new entries of the sequence's row (all of it for a new row, or after a preemption freed its blocks)."
        table = seq.block_table
        row, written, preemptions = self.rows.get(seq.seq_id) or (self._take_row(), 0, -1)
        if preemptions != seq.num_preemptions or written > len(table):
            self.table[row], written = -1, 0
        self.table[row, written:len(table)] = table[written:]
        self.rows[seq.seq_id] = entry = (row, len(table), seq.num_preemptions)
        return entry

    def _take_row(self) -> int:
        if not self.free_rows:   # full: twice as many rows
            n, self.table = len(self.table), np.concatenate([self.table, np.full_like(self.table, -1)])
            self.free_rows = list(range(2 * n - 1, n - 1, -1))
        return self.free_rows.pop()

    def free(self, seq_id: int) -> None:
        entry = self.rows.pop(seq_id, None)
        if entry is not None:
            self.free_rows.append(entry[0])

# %%
def prepare_decode(seqs: list[Sequence], block_size: int, tables: BlockTables,
                   ahead_rows: list[int] | None = None) -> StepInputs:
    "A decode step's host arrays without a loop over tokens; planned ahead (10), `input_ids` are rows of the samples."
    n = len(seqs)
    positions = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n) - (ahead_rows is None)
    block_tables = tables.array(seqs)
    blocks = block_tables[np.arange(n), positions // block_size].astype(np.int64)
    context_lens = (positions + 1).astype(np.int32)
    input_ids = (np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=n) if ahead_rows is None
                 else np.asarray(ahead_rows, dtype=np.int64))
    return StepInputs(
        input_ids=input_ids, positions=positions, slot_mapping=blocks * block_size + positions % block_size,
        logits_indices=np.arange(n, dtype=np.int64), seq_ids=seq_ids(seqs), cu_seqlens_q=np.arange(n + 1, dtype=np.int32),
        cu_seqlens_k=cumsum0(context_lens), context_lens=context_lens, block_tables=block_tables,
        shared_prefix_len=NO_PREFIX, max_seqlen_q=1, max_seqlen_k=int(context_lens.max()), ahead=ahead_rows is not None)

# %%
class BatchBuilder:
    "StepPlan -> StepInputs, for one engine: its block size, its block-table rows, and whether it may cascade."

    def __init__(self, block_size: int, max_model_len: int, max_num_seqs: int, cascade: bool = False):
        self.block_size, self.cascade = block_size, cascade
        self.tables = BlockTables(-(-max_model_len // block_size), max_num_seqs)

    def build(self, plan: StepPlan) -> StepInputs:
        if not plan.is_decode_only or plan.num_prefill_tokens:
            return prepare_step(plan, self.block_size)
        step = prepare_decode(plan.seqs, self.block_size, self.tables, plan.ahead_rows)
        if self.cascade:   # a prefix every sequence shares, read once for the whole batch (notebook 06)
            step.shared_prefix_len = np.array([cascade_prefix_len(step.block_tables, step.context_lens,
                                                                  self.block_size)], dtype=np.int32)
        return step

    def free(self, seq_id: int) -> None:
        self.tables.free(seq_id)
