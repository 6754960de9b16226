"""Tests of the picture code (minivllm.viz, minivllm.viz.timeline): the recorded data and that drawing works."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minivllm.engine.block_manager import BlockManager  # noqa: E402
from minivllm.engine.scheduler import Scheduler  # noqa: E402
from minivllm.engine.sequence import Sequence  # noqa: E402
from minivllm.engine.step_trace import StepRecord, token_times  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.viz import KVSnapshot, draw_fragmentation, draw_kv_cache, kv_cache_player, take_snapshot  # noqa: E402
from minivllm.viz.timeline import draw_timeline  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def two_sharing_sequences():
    bm = BlockManager(8, block_size=4)
    a, b = Sequence(list(range(10)), block_size=4), Sequence(list(range(9)) + [50, 51], block_size=4)
    for s in (a, b):
        match = bm.match_prefix(s)
        bm.allocate(s, s.num_tokens - match.num_tokens, match)
        s.num_computed_tokens = s.num_tokens
        bm.commit(s, match.num_tokens // bm.block_size)
    return bm, a, b


def test_take_snapshot_records_plain_data():
    bm, a, b = two_sharing_sequences()
    bm.free(a)
    snap = take_snapshot(bm, [b], "after a finished")
    assert snap.label == "after a finished" and snap.block_size == 4 and snap.num_blocks == 8
    assert snap.tables == {b.seq_id: [0, 1, 3]}
    assert snap.num_tokens == {b.seq_id: 11}
    assert snap.ref_counts == [1, 1, 0, 1, 0, 0, 0, 0]
    assert snap.cached == [True, True, False, False, False, False, False, False]
    assert snap.free_order == [2, 4, 5, 6, 7]  # a's partial block 2 (nothing cached) first
    assert snap.usage == 3 / 8
    b.block_table.append(99)  # a snapshot is a copy
    assert snap.tables[b.seq_id] == [0, 1, 3]


def test_draw_kv_cache_and_fragmentation_save_pictures(tmp_path):
    bm, a, b = two_sharing_sequences()
    snap = take_snapshot(bm, [a, b], "shared")
    fig = draw_kv_cache(snap, path=str(tmp_path / "kv.png"))
    assert (tmp_path / "kv.png").stat().st_size > 0
    assert "4/8 blocks in use (2 sequences), 2 cached" in fig.axes[0].get_title()
    assert not fig.axes[0].images
    fig, axes = plt.subplots(1, 2)
    draw_kv_cache(snap, ax=axes[0], blocks_per_row=4)
    draw_kv_cache(KVSnapshot("empty", 4, [0] * 8, [False] * 8), ax=axes[1])
    fig = draw_kv_cache(snap, compact=True)
    assert len(fig.axes[0].images) == 1  # the compact pool is one image
    big = KVSnapshot(
        "big", 16, [1] * 300 + [0] * 700, [False] * 1000, tables={0: list(range(300))}, num_tokens={0: 4800}
    )
    assert len(draw_kv_cache(big).axes[0].images) == 1  # compact automatically above 256 blocks
    fig = draw_fragmentation([10, 100, 33], max_model_len=128, block_size=16, path=str(tmp_path / "frag.png"))
    assert "reservation wastes" in fig.axes[0].get_title()


def test_kv_cache_player_steps_through_the_recording():
    bm, a, b = two_sharing_sequences()
    frames = [take_snapshot(bm, [a, b], "one"), take_snapshot(bm, [b], "two")]
    box = kv_cache_player(frames)
    slider = box.children[0].children[1]
    assert (slider.min, slider.max, slider.value) == (0, 1, 0)
    slider.value = 1
    with pytest.raises(ValueError, match="at least one snapshot"):
        kv_cache_player([])


def run_records(policy="mixed"):
    sched = Scheduler(
        num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32, policy=policy
    )
    seqs = [
        Sequence(list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=3, ignore_eos=True), block_size=4)
        for i, n in enumerate([6, 9, 5])
    ]
    for s in seqs:
        sched.add(s)
    records, clock = [], 0.0
    while sched.has_unfinished():
        plan = sched.schedule()
        finished = sched.postprocess(plan, [7] * sum(plan.is_sampled))
        records.append(StepRecord.from_step(len(records), plan, finished, sched, start=clock, duration=0.5, wait=0.125))
        clock += 0.5
    return seqs, records


def test_step_records_and_token_times():
    seqs, records = run_records()
    ids = [s.seq_id for s in seqs]
    r0, r1, r2 = records[:3]
    assert (r0.seq_ids, r0.num_tokens, r0.is_prefill, r0.sampled) == (ids[:2], [6, 2], [True, True], [True, False])
    assert (r1.seq_ids, r1.num_tokens, r1.is_prefill, r1.sampled) == (ids[:2], [1, 7], [False, True], [True, True])
    assert r2.finished == [ids[0]] and r2.total_tokens == 7 and r2.num_running == 2 and r2.num_waiting == 0
    assert records[-1].kv_usage == 0.0 and r0.kv_usage == 3 / 16  # 2 blocks for 6 tokens, 1 for a chunk of 2
    assert r0.wait == 0.125 and r0.preempted == [] and r0.span() == (0.0, 1.0) and r0.span(use_time=True) == (0.0, 0.5)
    assert not r0.is_decode_only and not r2.is_decode_only and records[3].is_decode_only
    assert StepRecord(0, [1], [1], [False], [True]).wait is None
    assert token_times(records) == {ids[0]: [1.0, 2.0, 3.0], ids[1]: [2.0, 3.0, 4.0], ids[2]: [3.0, 4.0, 5.0]}
    assert token_times(records, use_time=True)[ids[0]] == [0.5, 1.0, 1.5]


def test_draw_timeline(tmp_path):
    _, records = run_records()
    fig = draw_timeline(records, budget=8, title="t", path=str(tmp_path / "t.png"))
    assert len(fig.axes) == 3 and (tmp_path / "t.png").stat().st_size > 0
    draw_timeline(records, use_time=True)
    untimed = [StepRecord(0, [1], [3], [True], [True])]
    draw_timeline(untimed)
    with pytest.raises(ValueError, match="no start/duration"):
        draw_timeline(untimed, use_time=True)
    with pytest.raises(ValueError, match="at least one StepRecord"):
        draw_timeline([])
