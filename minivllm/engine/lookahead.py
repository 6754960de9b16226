from __future__ import annotations

from .scheduler import Scheduler, StepPlan


def plan_lookahead(scheduler: Scheduler, plan: StepPlan) -> StepPlan | None:
    """The decode step after `plan`, planned (blocks reserved) while it runs; None unless `plan` decodes every running
    sequence, no prompt waits and blocks suffice. Sequences it ends by length are left out (an eos: dropped later)."""
    running = len(scheduler.running)
    if (scheduler.policy != "mixed" or not plan.is_decode_only or not len(plan.sampled) == len(plan.seqs) == running
            or (scheduler.waiting and running < scheduler.max_num_seqs)):
        return None
    bs, limit, keep, rows, grow = scheduler.block_size, scheduler.max_model_len - 1, [], [], []
    for row, seq in enumerate(plan.seqs):
        n = len(seq.token_ids)
        if n >= limit or n + 1 >= seq.max_num_tokens:
            continue   # `plan` finishes it by length
        if n // bs >= len(seq.block_table):   # its next token starts a new block
            grow.append(seq)
        keep.append(seq)
        rows.append(row)
    if not keep or len(grow) > scheduler.block_manager.num_free_blocks:
        return None
    for seq in grow:
        scheduler.block_manager.reserve(seq, len(seq.token_ids) + 1)
    return StepPlan.decode(keep, ahead_rows=rows)
