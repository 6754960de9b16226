"""Tensor parallelism (notebook 11, project issue 7): worker processes, the step broadcast, the life cycle.

On the CPU (gloo), with the embedded tiny Qwen3 in float32:
- the step's arrays survive packing into one int32 array and unpacking into views, for any sizes and values;
- TP=2 gives the same greedy tokens (and logprobs to float rounding) as TP=1 for prompts of different lengths that are
  chunked and mixed with decodes;
- no process is left behind after `close()`, after `del llm; gc.collect()`, after a worker fails, and when the
  engine's process is killed;
- a worker's error (injected with MINIVLLM_TP_FAIL) reaches the caller as a RuntimeError that carries the worker's
  exception and traceback, within the test's time limit, during load and during a step;
- two TP=2 engines live in one process at once, and `torchrun` starts a working engine.
On two GPUs (NCCL, `@pytest.mark.gpu`): TP=2 against TP=1 in float32 with CUDA graphs, graphs against eager in
bfloat16, a worker failure under NCCL, and the benchmark with TP=2.
"""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams, TINY_MODEL_PATH
from minivllm.config import Config
from minivllm.distributed.executor import torchrun_group
from minivllm.distributed.group import TPGroup
from minivllm.distributed.launch import COMM_ENV, TorchrunEnv, master_store, set_comm_env, torchrun_env
from minivllm.distributed.parallel_state import get_tp_size
from minivllm.distributed.step_broadcast import HEADER, pack_step, payload_words, step_header, unpack_step
from minivllm.engine.model_runner import StepInputs, prepare_step
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=48)
PROMPTS = [  # 1 to ~90 tokens: one fits in a step, the long ones are chunked and share steps with decodes
    "x",
    "import os",
    "def fibonacci(n):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n    with open(path) as f:\n"
    "        data = json.load(f)\n    if not isinstance(data, dict):\n        raise ValueError(path)\n    return",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2)


def our_children() -> set[int]:
    "Child processes of the test process, without Python's own resource tracker (started by the first spawn)."
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


def completions(llm: LLM, params: SamplingParams = GREEDY):
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference():
    "TP=1 greedy completions: the reference every TP=2 run must reproduce (one thread: the tiny model needs no more)."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(TINY_MODEL_PATH, **ENGINE) as llm:
            return completions(llm)
    finally:
        torch.set_num_threads(threads)


def assert_same(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            assert np.allclose(list(lp_a.values()), list(lp_b.values()), atol=1e-4)


# ---------------------------------------------------------------- the step message (no processes)

def mixed_step() -> StepInputs:
    "A step that mixes a decode token, a prefill chunk and the start of a prompt (notebook 08's running example)."
    scheduler = Scheduler(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
    for ids in (list(range(10)), list(range(100, 120)), [7, 8]):
        scheduler.add(Sequence(ids, SamplingParams(max_tokens=8), block_size=4))
    first = scheduler.schedule()
    scheduler.postprocess(first, [0] * sum(first.sample_mask))
    return prepare_step(scheduler.schedule(), 4)


def assert_round_trip(x: StepInputs) -> None:
    header, packed = step_header(x), pack_step(x)
    assert header.dtype == np.int32 and len(header) == len(HEADER) and packed.dtype == np.int32
    assert header[HEADER.index("device_input_ids")] == 0 and step_header(x, True)[HEADER.index("device_input_ids")] == 1
    assert payload_words(header.tolist()) == len(packed)
    y = unpack_step(header.tolist(), packed)
    for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens",
                 "block_tables", "logits_indices"):
        ours, theirs = getattr(x, name), getattr(y, name)
        assert theirs.dtype == ours.dtype and theirs.shape == ours.shape and np.array_equal(theirs, ours)
        assert theirs.size == 0 or np.shares_memory(theirs, packed)   # a view of the received words, not a copy
    assert (y.max_seqlen_q, y.max_seqlen_k, y.is_decode_only) == (x.max_seqlen_q, x.max_seqlen_k, x.is_decode_only)
    assert (y.num_tokens, y.num_seqs) == (x.num_tokens, x.num_seqs)


def test_step_round_trip_of_a_mixed_step():
    x = mixed_step()
    assert not x.is_decode_only and len(x.logits_indices) == 2
    assert_round_trip(x)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_step_round_trip_of_any_sizes_and_values(data):
    "Any sizes (no sampled rows, one token, wide tables) and int64 values beyond int32, negative ones included."
    n = data.draw(st.integers(1, 40))
    b = data.draw(st.integers(1, min(n, 12)))
    w = data.draw(st.integers(1, 9))
    s = data.draw(st.integers(0, b))
    big = st.integers(-(2**62), 2**62)
    arr64 = lambda k: np.array(data.draw(st.lists(big, min_size=k, max_size=k)), dtype=np.int64)
    arr32 = lambda k: np.array(data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=k, max_size=k)),
                               dtype=np.int32)
    x = StepInputs(input_ids=arr64(n), positions=arr64(n), slot_mapping=arr64(n), cu_seqlens_q=arr32(b + 1),
                   cu_seqlens_k=arr32(b + 1), context_lens=arr32(b), block_tables=arr32(b * w).reshape(b, w),
                   logits_indices=arr64(s), max_seqlen_q=data.draw(st.integers(1, 10**6)),
                   max_seqlen_k=data.draw(st.integers(1, 10**6)), is_decode_only=data.draw(st.booleans()))
    assert_round_trip(x)


# ---------------------------------------------------------------- launch and groups (one process)

def test_torchrun_env_needs_all_five_variables(monkeypatch):
    names = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() is None
    for name, value in names.items():
        monkeypatch.setenv(name, value)
    assert torchrun_env() == TorchrunEnv(rank=1, world_size=2, local_rank=1)
    monkeypatch.delenv("MASTER_PORT")
    assert torchrun_env() is None


def test_comm_env_is_set_without_overriding_the_user(monkeypatch):
    for name in COMM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    set_comm_env()
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_torchrun_world_size_must_match():
    config = Config(TINY_MODEL_PATH, tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="torchrun started 4 processes, but tensor_parallel_size is 2"):
        torchrun_group(config, TorchrunEnv(rank=0, world_size=4, local_rank=0))


def test_each_group_is_the_default_only_while_active():
    "Two engines' groups in one process: each is the default inside its block, and nothing is outside."
    import torch.distributed as dist
    a = TPGroup.create("gloo", 0, 1, torch.device("cpu"), master_store(1))
    b = TPGroup.create("gloo", 0, 1, torch.device("cpu"), master_store(1))
    try:
        assert not dist.is_initialized()
        with a.active():
            assert dist.group.WORLD is a.device and get_tp_size() == 1
            with b.active():
                assert dist.group.WORLD is b.device
            assert dist.group.WORLD is a.device
        assert not dist.is_initialized()
    finally:
        a.destroy()
        b.destroy()
    assert not dist.is_initialized()


@pytest.mark.timeout(180)
def test_ranks_agree_on_the_smallest_kv_cache():
    "Rank 1 has twice rank 0's memory budget: both size their cache for rank 0's (the block manager's numbers)."
    import multiprocessing as mp

    from minivllm.engine.model_runner import num_kv_blocks
    ctx, budgets, here = mp.get_context("spawn"), [0.01, 0.02], os.path.dirname(__file__)
    sys.path.insert(0, here)   # the spawned ranks import the worker module from here
    try:
        import _tp_kv_worker
        results = ctx.Queue()
        rank0 = ctx.Process(target=_tp_kv_worker.run, args=(0, 0, budgets, results))
        rank0.start()
        kind, port = results.get(timeout=120)
        rank1 = ctx.Process(target=_tp_kv_worker.run, args=(1, port, budgets, results))
        rank1.start()
        blocks = dict(results.get(timeout=120) for _ in range(2))
        rank0.join(60), rank1.join(60)
    finally:
        sys.path.remove(here)
    small = Config(TINY_MODEL_PATH, tensor_parallel_size=2, device="cpu", max_model_len=256, max_num_seqs=256)
    expected = num_kv_blocks(small, int(budgets[0] * 2**30))
    assert kind == "port" and blocks == {0: expected, 1: expected}
    assert expected < num_kv_blocks(small, int(budgets[1] * 2**30))
    assert rank0.exitcode == 0 and rank1.exitcode == 0


# ---------------------------------------------------------------- TP=2 engines on the CPU

@pytest.mark.timeout(300)
def test_tp2_matches_tp1_and_close_leaves_no_process(reference):
    before = our_children()
    llm = LLM(TINY_MODEL_PATH, tensor_parallel_size=2, **ENGINE)
    runner = llm.llm_engine.model_runner
    assert type(runner).__name__ == "TensorParallelRunner" and runner.device == torch.device("cpu")
    assert len(our_children() - before) == 1
    assert_same(completions(llm), reference)
    llm.close()
    assert our_children() == before
    with pytest.raises(RuntimeError, match="closed"):
        completions(llm)


@pytest.mark.timeout(300)
def test_two_tp2_engines_alive_at_once_and_garbage_collection(reference):
    before = our_children()
    a = LLM(TINY_MODEL_PATH, tensor_parallel_size=2, **ENGINE)
    b = LLM(TINY_MODEL_PATH, tensor_parallel_size=2, **ENGINE)
    try:
        assert len(our_children() - before) == 2
        assert_same(completions(a), reference)
        assert_same(completions(b), reference)
        stream = b.stream(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24))   # interleave the two engines
        first = next(stream)
        assert_same(completions(a), reference)
        rest = [t for out in stream for t in out.outputs[0].token_ids]
        assert first.outputs[0].token_ids + rest == reference[2].token_ids
    finally:
        a.close()
    assert len(our_children() - before) == 1   # b's worker
    del b, stream
    gc.collect()
    assert our_children() == before


@pytest.mark.timeout(180)
def test_worker_failure_during_load_is_raised(monkeypatch):
    before = our_children()
    monkeypatch.setenv("MINIVLLM_TP_FAIL", "1:load")
    with pytest.raises(RuntimeError) as info:
        LLM(TINY_MODEL_PATH, tensor_parallel_size=2, **ENGINE)
    message = str(info.value)
    assert message.startswith("tensor-parallel worker rank 1 failed: RuntimeError: injected failure of rank 1 "
                              "during load")
    assert "--- traceback of rank 1 ---\nTraceback (most recent call last):" in message
    assert "in inject_failure" in message
    assert our_children() == before


@pytest.mark.timeout(180)
def test_worker_failure_during_a_step_is_raised_and_the_engine_refuses_more(monkeypatch):
    before = our_children()
    monkeypatch.setenv("MINIVLLM_TP_FAIL", "1:step")
    llm = LLM(TINY_MODEL_PATH, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(RuntimeError, match="rank 1 failed: RuntimeError: injected failure of rank 1 during step"):
        completions(llm)
    assert our_children() == before   # the failed group was taken down at once
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match=r"the tensor-parallel group is down \(make a new LLM\)"):
        completions(llm)
    llm.close()


@pytest.mark.timeout(180)
def test_a_worker_killed_while_idle_fails_the_next_step():
    before = our_children()
    llm = LLM(TINY_MODEL_PATH, tensor_parallel_size=2, **ENGINE)
    (worker,) = our_children() - before
    os.kill(worker, signal.SIGKILL)   # (not psutil's wait(): it would reap the process before multiprocessing does)
    with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1 was killed by signal 9 unexpectedly"):
        completions(llm)
    llm.close()
    assert our_children() == before


@pytest.mark.timeout(180)
def test_a_script_without_main_guard_gets_a_clear_error(tmp_path):
    "Spawned workers import the main script again; without the guard they would start engines of their own."
    script = tmp_path / "no_guard.py"
    script.write_text(f"from minivllm import LLM\nLLM({TINY_MODEL_PATH!r}, tensor_parallel_size=2, **{ENGINE!r})\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor-parallel worker rank 1 exited with code 1 before it started")
    assert 'create the LLM under `if __name__ == "__main__":`' in last


@pytest.mark.timeout(180)
def test_workers_exit_when_the_engine_process_is_killed(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        import psutil
        from minivllm import LLM
        if __name__ == "__main__":
            llm = LLM({TINY_MODEL_PATH!r}, tensor_parallel_size=2, **{ENGINE!r})
            print(*[p.pid for p in psutil.Process().children()
                    if "resource_tracker" not in " ".join(p.cmdline())], flush=True)
            time.sleep(600)
    """))
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        workers = [psutil.Process(int(pid)) for pid in engine.stdout.readline().split()]
        assert len(workers) == 1 and workers[0].is_running()
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait()
    gone, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive


@pytest.mark.timeout(300)
def test_torchrun_starts_a_working_engine(tmp_path, reference):
    script = tmp_path / "generate.py"
    script.write_text(textwrap.dedent(f"""
        from minivllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({TINY_MODEL_PATH!r}, tensor_parallel_size=2, **{ENGINE!r})
            for out in llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False):
                print(out.outputs[0].token_ids)
            llm.close()
            print("rank 0 closed the engine")
    """))
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_TP_FAIL"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=280, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == "rank 0 closed the engine"   # printed once: the other rank never returns from LLM(...)
    assert lines[:-1] == [str(r.token_ids) for r in reference]


# ---------------------------------------------------------------- two GPUs (NCCL)

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs")


def random_qwen3_0_6b() -> str:
    "The Qwen3-0.6B architecture with seeded random weights (the benchmark's folder, made once)."
    from minivllm.bench import random_qwen3_folder
    return random_qwen3_folder(os.path.join(os.path.expanduser("~"), ".cache", "minivllm", "qwen3-0.6b-random"))


def gpu_tokens(folder: str, prompts: list[list[int]], max_tokens: int, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(folder, skip_tokenizer_init=True, gpu_memory_utilization=0.5, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.gpu
@two_gpus
@pytest.mark.timeout(900)
def test_gpu_tp2_matches_tp1_float32_with_cuda_graphs():
    folder, gen = random_qwen3_0_6b(), torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (int(n),), generator=gen).tolist()
               for n in torch.randint(16, 512, (8,), generator=gen)]
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_seqs=8)
    tp1 = gpu_tokens(folder, prompts, 64, tensor_parallel_size=1, **kwargs)
    tp2 = gpu_tokens(folder, prompts, 64, tensor_parallel_size=2, **kwargs)
    assert all(len(t) == 64 for t in tp2)
    assert tp2 == tp1


@pytest.mark.gpu
@two_gpus
@pytest.mark.timeout(900)
def test_gpu_tp2_cuda_graphs_match_eager_float32():
    """16 prompts of one length: every decode step is a batch of 16, a recorded size. In float32 graphs and eager give
    the same tokens; in bfloat16 they need not (measured on the H200, at TP=1 and TP=2): replayed and eager steps may
    run differently-tiled kernels (split-KV sized for max_model_len, the matrix library's choices under capture), and
    a last-bit difference flips a near-tied argmax of random weights (notebook 08 shows it)."""
    folder, gen = random_qwen3_0_6b(), torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 10000, (16, 300), generator=gen).tolist()
    kwargs = dict(tensor_parallel_size=2, dtype="float32", max_model_len=1024, max_num_seqs=16)
    graphs = gpu_tokens(folder, prompts, 48, **kwargs)
    eager = gpu_tokens(folder, prompts, 48, enforce_eager=True, **kwargs)
    assert graphs == eager


@pytest.mark.gpu
@two_gpus
@pytest.mark.timeout(600)
def test_gpu_worker_failure_is_raised_and_the_gpus_stay_usable(monkeypatch):
    folder = random_qwen3_0_6b()
    monkeypatch.setenv("MINIVLLM_TP_FAIL", "1:step")
    with pytest.raises(RuntimeError, match="rank 1 failed: RuntimeError: injected failure of rank 1 during step"):
        gpu_tokens(folder, [[1, 2, 3]], 4, tensor_parallel_size=2, max_model_len=1024, max_num_seqs=8)
    monkeypatch.delenv("MINIVLLM_TP_FAIL")
    assert len(gpu_tokens(folder, [[1, 2, 3]], 4, tensor_parallel_size=2, max_model_len=1024, max_num_seqs=8)[0]) == 4


@pytest.mark.gpu
@two_gpus
@pytest.mark.timeout(1200)
def test_gpu_benchmark_runs_with_tp2(capsys):
    from minivllm.bench import main
    assert main(["--tensor-parallel-size", "2", "--num-seqs", "64", "--max-input", "256", "--max-output", "128"]) == 0
    assert "output tok/s" in capsys.readouterr().out
