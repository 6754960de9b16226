"""End to end: greedy generation token-identical to transformers' `generate`, on CPU (the tiny model) and on a GPU
(the Qwen3-0.6B architecture with random weights, float32), with prefix caching on and off, under preemption, with
chunked prefill, and with CUDA graphs against eager execution. Cascade decode gives the tokens of plain attention.
Engines in one process are independent (project issue 21), and the step trace records every step."""

import dataclasses
import gc
import itertools
import random
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.engine.step_trace import token_times
from minivllm.models.registry import load_config

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        ",
    "for i in range(10):\n",
    "    return",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "x",
    "try:\n    import json\nexcept ImportError:\n    json = None\n\n\ndef load(path):\n",
]
MAX_TOKENS = 24


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    "transformers' generate, one prompt at a time (no padding), greedy; stops at eos like the engine does."
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
        out.append(y[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def tiny_reference():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    ids = [tok.encode(p) for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    return ids, hf_greedy(hf, ids, MAX_TOKENS)


SETTINGS = {
    "default": dict(),
    "no prefix caching": dict(enable_prefix_caching=False),
    "preemption": dict(num_kvcache_blocks=24, block_size=4, max_num_seqs=8, max_model_len=64),
    "chunked prefill": dict(max_num_batched_tokens=8, max_num_seqs=4),
    "no chunked prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=128, max_num_seqs=8),
    "block size 1": dict(block_size=1, max_model_len=64),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_tiny_greedy_matches_transformers(tiny_reference, name):
    ids, reference = tiny_reference
    kwargs = {"max_model_len": 128, **SETTINGS[name]}
    with LLM(TINY_MODEL_PATH, **kwargs) as llm:
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        engine = llm.llm_engine
        if name == "preemption":
            assert engine.scheduler.num_preemptions > 0
        if name == "chunked prefill":
            assert engine.stats.num_steps > MAX_TOKENS + 2  # prompts took several steps each
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not engine.requests


def test_prefix_cache_is_hit_and_outputs_do_not_change(tiny_reference):
    ids, reference = tiny_reference
    shared = ids[7] * 3  # 3 copies of the longest prompt: at least 2 full blocks of 16
    with LLM(TINY_MODEL_PATH, max_model_len=256) as llm:
        first = llm.generate([shared], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        second = llm.generate([shared], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(shared) - 1) // 16 * 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_cpu_runner_packs_every_linear_weight():
    "On a CPU the runner gives each linear layer and the LM head oneDNN's copy (the greedy tests above run on it)."
    with LLM(TINY_MODEL_PATH, max_model_len=128, device="cpu") as llm:
        slots = [m for m in llm.llm_engine.executor.runner.model.modules() if hasattr(m, "packed_weight")]
        assert len(slots) == 4 * 8 + 1 and all(m.packed_weight is not None for m in slots)


# ---- on a GPU: Qwen3-0.6B's architecture, random weights, float32 ------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    from minivllm.bench import random_qwen3_folder

    path = str(tmp_path_factory.mktemp("qwen3") / "qwen3-0.6b-random-f32")
    return random_qwen3_folder(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def gpu_prompts_and_reference(qwen3_06b):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (5, 17, 64, 100, 129, 250, 300, 511)]
    hf = AutoModelForCausalLM.from_pretrained(qwen3_06b, dtype=torch.float32).cuda()
    hf.generation_config.eos_token_id = None  # the engine runs with ignore_eos: 64 tokens each
    hf.generation_config.pad_token_id = 0
    reference = hf_greedy(hf, prompts, 64)
    del hf
    torch.cuda.empty_cache()
    return prompts, reference


GPU_SETTINGS = {
    "cuda graphs": dict(),
    "eager": dict(enforce_eager=True),
    "no prefix caching": dict(enable_prefix_caching=False),
    "preemption": dict(num_kvcache_blocks=80, max_num_seqs=8, max_model_len=1024),
    "chunked prefill": dict(max_num_batched_tokens=64, max_num_seqs=8),
    "block size 256": dict(block_size=256),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SETTINGS))
def test_qwen3_06b_float32_greedy_matches_transformers_on_gpu(qwen3_06b, gpu_prompts_and_reference, name):
    prompts, reference = gpu_prompts_and_reference
    kwargs = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.5)
    with LLM(qwen3_06b, **{**kwargs, **GPU_SETTINGS[name]}) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        if name == "preemption":
            assert llm.llm_engine.scheduler.num_preemptions > 0
    same = [g == r for g, r in zip(got, reference)]
    assert all(same), f"{name}: prompts {[i for i, s in enumerate(same) if not s]} differ from transformers"


# ---- mixed steps in CUDA graphs (notebook 09): the buckets, the padding, the tokens --------------------------------


def test_mixed_token_sizes_are_powers_of_two_up_to_the_budget():
    from minivllm.engine.cuda_graph import MIXED_GRAPH_MAX_TOKENS, mixed_token_sizes

    assert mixed_token_sizes(16384) == [128, 256, 512, 1024, 2048] == mixed_token_sizes(2048)
    assert mixed_token_sizes(1000) == [128, 256, 512, 1000]
    assert mixed_token_sizes(64) == [64] and mixed_token_sizes(128) == [128]
    assert mixed_token_sizes(10**6)[-1] == MIXED_GRAPH_MAX_TOKENS


def test_a_mixed_step_padded_for_a_graph_reads_and_writes_nothing_more():
    "The padded views give the sampled rows of the plain step; spare tokens write nothing, spare sequences are empty."
    from minivllm.engine.batch_builder import prepare_step
    from minivllm.engine.cuda_graph import GraphInputs
    from minivllm.engine.scheduler import Scheduler
    from minivllm.engine.sequence import Sequence
    from minivllm.engine.step_inputs import to_device

    with LLM(TINY_MODEL_PATH, device="cpu", max_model_len=128, attention_backend="torch") as llm:
        runner = llm.llm_engine.executor.runner
        scheduler = Scheduler(runner.num_blocks, 16, 8, 64, 128)
        for i, n in enumerate((20, 3, 60)):
            scheduler.add(Sequence(list(range(5, 5 + n)), SamplingParams(max_tokens=4), block_size=16, seq_id=i))
        first = scheduler.schedule()  # 64 tokens: two prompts and a chunk of the third
        scheduler.postprocess(first, [1] * len(first.sampled_seqs))
        step = prepare_step(scheduler.schedule(), 16)  # two decodes and the rest of the third prompt
        assert not step.is_decode_only and step.sizes.num_seqs == 3
        with torch.inference_mode():
            x = to_device(step, torch.device("cpu"))
            want = runner.model(x.input_ids, x.positions, x.meta)[x.logits_indices]
            inputs = GraphInputs(max_batch_size=8, max_blocks=8, device=torch.device("cpu"), max_tokens=128)
            inputs.views["slot_mapping"].fill_(5)  # stale values of an earlier step
            inputs.load(step, batch_size=8, input_ids=None, tokens=128)
            v, t, n = inputs.views, step.sizes.num_tokens, step.sizes.num_seqs
            assert (v["slot_mapping"][t:128] == -1).all() and (v["context_lens"][n:] == 0).all()
            assert (v["cu_seqlens_q"][n:] == t).all() and (v["logits_indices"][step.sizes.num_sampled :] == 0).all()
            g = inputs.step(8, 128, tokens=128)  # the views a mixed graph is recorded with
            assert len(g.input_ids) == 128 and g.meta.max_seqlen_q == 128 and not g.meta.is_decode_only
            got = runner.model(g.input_ids, g.positions, g.meta)[g.logits_indices]
    torch.testing.assert_close(got[: len(want)], want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_mixed_steps_replay_graphs_and_give_the_tokens_of_eager(tiny_reference, monkeypatch):
    "Prompts arrive while others decode (4 seats, 8 requests of different lengths): those steps replay mixed graphs."
    from minivllm.engine.cuda_graph import MixedGraphRunner

    ids, _ = tiny_reference
    replays, original = [], MixedGraphRunner.replay
    monkeypatch.setattr(
        MixedGraphRunner, "replay", lambda self, step, *args: replays.append(step) or original(self, step, *args)
    )
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * i, ignore_eos=True) for i in range(len(ids))]
    got = {}
    for eager in (False, True):
        with LLM(TINY_MODEL_PATH, dtype="float32", max_model_len=256, max_num_seqs=4, enforce_eager=eager) as llm:
            assert (llm.llm_engine.executor.runner.mixed_graphs is None) == eager
            got[eager] = token_ids(llm.generate(ids, params, use_tqdm=False))
    assert any(s.sizes.num_seqs > 1 and s.max_seqlen_q > 1 and s.sizes.num_sampled for s in replays)
    assert got[False] == got[True]


# ---- cascade decode: a prefix shared by the whole batch is read once (notebook 05) ------------------------------


def _generate_with_shared_prefix(
    ids, monkeypatch, num_requests: int = 5, max_tokens: int = 8, warm_tokens: int = 8, **kwargs
):
    """Cache a shared prefix with one request (of `warm_tokens`), then decode `num_requests` requests that start with
    it (`max_tokens` each); thresholds lowered to fit. Returns the tokens, the shared prefix length the batch builder
    gave each decode step, the prefix's length, and whether CUDA graphs that read a shared prefix once were recorded
    (None without graphs)."""
    from minivllm.engine.batch_builder import BatchBuilder
    from minivllm.kernels import cascade_plan as cascade  # the thresholds use_cascade reads (plain numpy)

    monkeypatch.setattr(cascade, "CASCADE_MIN_PREFIX", 16)
    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED", 16)
    used, original = [], BatchBuilder.build

    def spy(self, plan):
        step = original(self, plan)
        if step.is_decode_only:  # what the graph replay and the eager path both read
            used.append(int(step.shared_prefix_len[0]))
        return step

    monkeypatch.setattr(BatchBuilder, "build", spy)
    shared = ids[7] + ids[0] + ids[2]
    prompts = [shared + tail for tail in ids[:num_requests]]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)  # every step has them all
    with LLM(TINY_MODEL_PATH, max_model_len=256, **kwargs) as llm:
        engine = llm.llm_engine
        assert engine.config.cascade and engine.builder.cascade
        llm.generate([shared], SamplingParams(temperature=0, max_tokens=warm_tokens), use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = engine.executor.runner.graphs
        cascade_graphs = None if graphs is None else bool(graphs.cascade_graphs)
    return [o.outputs[0].token_ids for o in outs], used, len(shared), cascade_graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the Triton kernels (interpreter)")
def test_cascade_decode_on_cpu_gives_the_tokens_of_plain_attention(tiny_reference, monkeypatch):
    "Three requests, 4 tokens each (the interpreter runs every program of every kernel in Python: kept small)."
    ids, _ = tiny_reference
    got, used, n, _ = _generate_with_shared_prefix(
        ids, monkeypatch, num_requests=3, max_tokens=4, warm_tokens=1, device="cpu", attention_backend="triton"
    )
    assert max(used) == (n - 1) // 16 * 16 > 0  # the decode steps of the 3 requests read the prefix once
    assert len(used) >= 2 and all(len(t) == 4 for t in got)  # (none stopped early: every decode step had all 3)
    with LLM(TINY_MODEL_PATH, max_model_len=256, device="cpu", attention_backend="torch") as llm:
        assert not llm.llm_engine.config.cascade
        want = llm.generate(
            [ids[7] + ids[0] + ids[2] + tail for tail in ids[:3]],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
    assert got == [o.outputs[0].token_ids for o in want]


@pytest.mark.gpu
def test_gpu_cascade_decode_with_cuda_graphs_gives_the_tokens_of_eager_plain_attention(tiny_reference, monkeypatch):
    ids, _ = tiny_reference
    got, used, n, cascade_graphs = _generate_with_shared_prefix(ids, monkeypatch, dtype="float32")
    assert cascade_graphs  # the decode steps replay the graphs that read the prefix once
    assert used[-1] == (n - 1) // 16 * 16 > 0
    with LLM(TINY_MODEL_PATH, max_model_len=256, dtype="float32", enable_prefix_caching=False) as llm:
        assert not llm.llm_engine.config.cascade
        want = llm.generate(
            [ids[7] + ids[0] + ids[2] + tail for tail in ids[:5]],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    assert got == [o.outputs[0].token_ids for o in want]


# ---- engines in one process are independent (project issue 21) -------------------------------------------------

VOCAB = load_config(TINY_MODEL_PATH).vocab_size
CPU_ENGINE = dict(device="cpu", max_model_len=128, max_num_seqs=16)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def vocab_prompts(n: int, seed: int, max_len: int = 60) -> list[list[int]]:
    "n prompts of random token ids of the tiny model's vocabulary, 1 to max_len tokens long."
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def mixed_params(n: int, seed: int, max_tokens: int = 10) -> list[SamplingParams]:
    """Greedy, seeded and unseeded sampling in turn. The unseeded rows draw from the engine's own generator: they give
    the same tokens as the engine alone only if no other engine draws from it (or from any generator it uses)."""
    kinds = [dict(temperature=0), dict(temperature=0.9, top_k=50, seed=seed), dict(temperature=1.0, top_p=0.9)]
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kinds[i % 3]) for i in range(n)]


A_WORK = [(vocab_prompts(10, seed), mixed_params(10, seed)) for seed in (1, 2, 3)]
B_WORK = (vocab_prompts(10, 4), mixed_params(10, 4))
B_STREAM = (vocab_prompts(1, 5)[0], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))


def drive(engine, prompts, params, between=None) -> list[list[int]]:
    "Add the requests to the engine and step it until they finish (calling `between()` before each step)."
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    got = {}
    while engine.has_unfinished_requests():
        if between is not None:
            between()
        got.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return [got[i] for i in ids]


class Stream:
    "`llm.stream(...)` advanced one output at a time; `tokens` collects the deltas' tokens."

    def __init__(self, llm: LLM, prompt, params: SamplingParams):
        self.outputs, self.tokens, self.done = llm.stream(prompt, params), [], False

    def advance(self) -> None:
        out = None if self.done else next(self.outputs, None)
        if out is None:
            self.done = True
        else:
            self.tokens += out.outputs[0].token_ids

    def finish(self) -> list[int]:
        while not self.done:
            self.advance()
        return self.tokens


def engine_a_alone(kwargs) -> list[list[list[int]]]:
    with LLM(TINY_MODEL_PATH, **kwargs) as a:
        return [
            token_ids(a.generate(*A_WORK[0], use_tqdm=False)),
            token_ids(a.generate(*A_WORK[1], use_tqdm=False)),
            drive(a.llm_engine, *A_WORK[2]),
        ]


def engine_b_alone(kwargs) -> list:
    with LLM(TINY_MODEL_PATH, **kwargs) as b:
        return [token_ids(b.generate(*B_WORK, use_tqdm=False)), Stream(b, *B_STREAM).finish()]


def check_interleaved_engines_give_their_own_tokens(kwargs_a: dict, kwargs_b: dict) -> None:
    "Engine A generates, engine B generates, A again, B streams while A generates: each gives its tokens alone."
    want_a, want_b = engine_a_alone(kwargs_a), engine_b_alone(kwargs_b)
    with LLM(TINY_MODEL_PATH, **kwargs_a) as a, LLM(TINY_MODEL_PATH, **kwargs_b) as b:
        got_a = [token_ids(a.generate(*A_WORK[0], use_tqdm=False))]
        got_b = [token_ids(b.generate(*B_WORK, use_tqdm=False))]
        got_a.append(token_ids(a.generate(*A_WORK[1], use_tqdm=False)))
        stream = Stream(b, *B_STREAM)
        got_a.append(drive(a.llm_engine, *A_WORK[2], between=stream.advance))
        assert stream.tokens, "the stream should have made progress while engine A generated"
        got_b.append(stream.finish())
        for llm in (a, b):
            bm = llm.llm_engine.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks and not llm.llm_engine.requests
    assert got_a == want_a, "engine A gave other tokens next to engine B than alone"
    assert got_b == want_b, "engine B gave other tokens next to engine A than alone"


CPU_PAIRS = {
    "float32 and bfloat16": (dict(dtype="float32"), dict(dtype="bfloat16")),
    "block sizes 16 and 4": (dict(block_size=16), dict(block_size=4)),
}


@pytest.mark.parametrize("pair", list(CPU_PAIRS))
def test_interleaved_cpu_engines_each_give_their_own_tokens(pair):
    kwargs_a, kwargs_b = ({**CPU_ENGINE, **kw} for kw in CPU_PAIRS[pair])
    check_interleaved_engines_give_their_own_tokens(kwargs_a, kwargs_b)


def test_a_deleted_engine_leaves_nothing_another_engine_depends_on():
    prompts = vocab_prompts(8, 6)
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, **kind)  # greedy and seeded: the same every call
        for kind in itertools.islice(itertools.cycle([dict(temperature=0), dict(temperature=0.9, seed=7)]), 8)
    ]
    first = LLM(TINY_MODEL_PATH, **CPU_ENGINE, dtype="bfloat16")
    second = LLM(TINY_MODEL_PATH, **CPU_ENGINE, block_size=4)  # made before the first is deleted
    try:
        want = token_ids(second.generate(prompts, params, use_tqdm=False))
        first.generate(prompts, params, use_tqdm=False)
        assert token_ids(second.generate(prompts, params, use_tqdm=False)) == want
        engine, model = weakref.ref(first.llm_engine), weakref.ref(first.llm_engine.executor.runner.model)
        first.close()
        del first
        gc.collect()
        assert engine() is None and model() is None, "the deleted engine's engine or model is still alive"
        assert token_ids(second.generate(prompts, params, use_tqdm=False)) == want
        assert Stream(second, prompts[0], params[0]).finish() == want[0]
        with LLM(TINY_MODEL_PATH, **CPU_ENGINE, block_size=4) as third:  # and a new one gives them too
            assert token_ids(third.generate(prompts, params, use_tqdm=False)) == want
        assert token_ids(second.generate(prompts, params, use_tqdm=False)) == want
    finally:
        second.close()


def tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(itertools.chain(model.parameters(), model.buffers()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_models_in_one_process_share_no_module_or_tensor(dtype):
    with LLM(TINY_MODEL_PATH, **CPU_ENGINE, dtype=dtype) as a, LLM(TINY_MODEL_PATH, **CPU_ENGINE, dtype=dtype) as b:
        runner_a, runner_b = a.llm_engine.executor.runner, b.llm_engine.executor.runner
        model_a, model_b = runner_a.model, runner_b.model
        rope_a, rope_b = (m.model.layers[0].self_attn.rotary_emb for m in (model_a, model_b))
        assert rope_a is not rope_b
        assert all(layer.self_attn.rotary_emb is rope_a for layer in model_a.model.layers)  # one per model
        assert all(layer.self_attn.rotary_emb is rope_b for layer in model_b.model.layers)
        assert rope_a.cos_sin_cache.data_ptr() != rope_b.cos_sin_cache.data_ptr()
        assert not {id(m) for m in model_a.modules()} & {id(m) for m in model_b.modules()}
        ta, tb = tensors(model_a), tensors(model_b)
        assert len(ta) == len(tb) > 0 and any(t is rope_a.cos_sin_cache for t in ta)
        assert not {t.data_ptr() for t in ta} & {t.data_ptr() for t in tb}
        assert not {t.untyped_storage().data_ptr() for t in ta} & {t.untyped_storage().data_ptr() for t in tb}
        assert runner_a.kv_cache.untyped_storage().data_ptr() != runner_b.kv_cache.untyped_storage().data_ptr()
        assert runner_a.sampling.generator is not runner_b.sampling.generator


# ---- the same on a GPU: CUDA graphs, a CPU engine beside it, memory churn --------------------------------------

GPU_ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
GPU_PROMPTS = PROMPTS + [
    "def quicksort(xs):\n    ",
    "with open(path) as f:\n    ",
    'if __name__ == "__main__":\n',
    "import numpy as np\n\n\ndef mean(",
    "class Node:\n    def __init__(self, value",
    "while True:\n",
    "def add(a, b):\n    return",
    "# Read the file\nlines = ",
]


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_gpu_engine_gives_its_tokens_after_a_cpu_engine_and_memory_churn():
    assert len(GPU_PROMPTS) == 16
    params = SamplingParams(temperature=0, max_tokens=32)
    gpu = LLM(TINY_MODEL_PATH, **GPU_ENGINE, max_num_seqs=16)
    try:
        assert gpu.llm_engine.executor.runner.graphs is not None  # CUDA graphs on
        first = token_ids(gpu.generate(GPU_PROMPTS, params, use_tqdm=False))
        with LLM(TINY_MODEL_PATH, device="cpu", dtype="float32", max_model_len=512) as cpu:
            assert token_ids(cpu.generate(GPU_PROMPTS, params, use_tqdm=False)) == first
        churn = [torch.full((64 * 2**20,), 255, dtype=torch.uint8, device="cuda") for _ in range(6)]  # 384 MiB
        del churn
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert token_ids(gpu.generate(GPU_PROMPTS, params, use_tqdm=False)) == first
    finally:
        gpu.close()


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_gpu_flash_attn_gives_the_tokens_of_the_triton_kernels():
    "bfloat16 (flash-attn's dtypes): flash-attn for prefill only (the automatic choice), and for both phases."
    from minivllm.kernels.backends import flash_attn_version

    if flash_attn_version() != 4 or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs flash-attn-4 on a Hopper or Blackwell GPU")
    params = SamplingParams(temperature=0, max_tokens=32)
    bf16 = {**GPU_ENGINE, "dtype": "bfloat16", "max_num_seqs": 16}
    tokens = {}
    for name, backend in [("triton", "triton"), ("auto", None), ("flash_attn", "flash_attn")]:
        with LLM(TINY_MODEL_PATH, **bf16, attention_backend=backend) as llm:
            config = llm.llm_engine.config
            tokens[name] = token_ids(llm.generate(GPU_PROMPTS, params, use_tqdm=False))
            tokens[name + " again"] = token_ids(llm.generate(GPU_PROMPTS, params, use_tqdm=False))  # CUDA graphs
        if name == "auto":
            assert (config.attention_backend, config.prefill_backend) == ("triton", "flash_attn")
    assert all(tokens[name] == tokens["triton"] for name in tokens), {
        name: sum(a == b for a, b in zip(t, tokens["triton"])) for name, t in tokens.items()
    }


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_interleaved_gpu_engines_of_different_shapes_each_give_their_own_tokens():
    check_interleaved_engines_give_their_own_tokens(
        {**GPU_ENGINE, "max_num_seqs": 8, "block_size": 16}, {**GPU_ENGINE, "max_num_seqs": 32, "block_size": 32}
    )


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_collect_waits_for_its_own_step_not_for_work_queued_after_it():
    "Asynchronous scheduling overlaps only if `collect(N)` returns while what was launched after step N still runs."
    llm = LLM(TINY_MODEL_PATH, **GPU_ENGINE)
    engine = llm.llm_engine
    try:
        engine.add_request(None, "def fibonacci(n):\n    ", SamplingParams(temperature=0, max_tokens=8))
        handle = engine.executor.launch(engine.builder.build(engine.scheduler.schedule()))
        torch.cuda._sleep(
            2_000_000_000
        )  # about a second of GPU work queued behind the step, like a step launched ahead
        after = torch.cuda.current_stream().record_event()
        token_ids, _ = engine.executor.collect(handle)
        assert len(token_ids) == 1 and not after.query()  # the tokens came back while the later work still ran
        torch.cuda.synchronize()
    finally:
        llm.close()


# ---- the step trace ---------------------------------------------------------------------------------------------


def test_step_trace_records_every_step():
    prompts = vocab_prompts(8, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(TINY_MODEL_PATH, **{**CPU_ENGINE, "max_num_batched_tokens": 32, "max_num_seqs": 8}) as llm:
        engine = llm.llm_engine
        assert engine.trace is None
        llm.generate(prompts[:2], params, use_tqdm=False)  # steps before start_trace are not recorded
        before = dataclasses.replace(engine.stats)
        trace = engine.start_trace()
        assert trace == [] and engine.trace is trace
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = engine.stats
    n = stats.num_steps - before.num_steps
    assert n > 0 and len(trace) == n  # one record per engine step
    assert [r.step for r in trace] == list(range(n))
    for r, after in zip(trace, trace[1:] + [None]):
        assert r.duration >= r.wait >= 0 and r.start >= 0
        if after is not None:
            assert r.start + r.duration <= after.start + 1e-6  # steps do not overlap
        assert len(r.seq_ids) == len(r.num_tokens) == len(r.is_prefill) == len(r.sampled) > 0
        if r.is_decode_only:  # no prefill tokens: every sequence computes one token and samples one
            assert sum(k for k, p in zip(r.num_tokens, r.is_prefill) if p) == 0
            assert all(k == 1 for k in r.num_tokens) and all(r.sampled)
        assert 0 <= r.kv_usage <= 1
    assert any(r.is_decode_only for r in trace) and not trace[0].is_decode_only
    assert (
        sum(k for r in trace for k, p in zip(r.num_tokens, r.is_prefill) if p)
        == stats.num_prompt_tokens - before.num_prompt_tokens
        == sum(len(p) - o.num_cached_tokens for p, o in zip(prompts, outs))
    )
    assert sum(sum(r.sampled) for r in trace) == stats.num_generated_tokens - before.num_generated_tokens
    assert len([s for r in trace for s in r.finished]) == len(prompts)
    assert trace[-1].num_running == trace[-1].num_waiting == 0
    times = token_times(trace)
    assert sorted(map(len, times.values())) == sorted(len(o.outputs[0].token_ids) for o in outs)


def test_no_step_is_left_in_flight_once_every_request_finished():
    """With asynchronous scheduling the next decode step is launched before a step's tokens are seen; a request that
    ends on a stop token has one more token computed, dropped when that step is collected. Once every request has
    finished, the engine must hold no such step: its next `step()` has nothing to do (no step counted, no record)."""
    with LLM(TINY_MODEL_PATH, **CPU_ENGINE) as llm:
        engine = llm.llm_engine
        assert engine.config.async_scheduling
        toks = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        toks = toks.outputs[0].token_ids
        i = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])  # a decode step ends it
        generated = engine.stats.num_generated_tokens
        out = llm.generate(
            [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[toks[i]]), use_tqdm=False
        )[0].outputs[0]
        assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", toks[i], toks[: i + 1])
        assert not engine.has_unfinished_requests() and not engine.requests
        assert engine.in_flight is None, "a step of finished requests is still in flight"
        before, trace = dataclasses.replace(engine.stats), engine.start_trace()
        assert engine.step() == []
        assert engine.stats == before and trace == []
        assert engine.stats.num_generated_tokens - generated == len(out.token_ids)


# ---- the greedy pick recorded in the graphs (notebook 09) ------------------------------------------------------


def test_a_graphs_greedy_pick_is_taken_only_for_an_all_greedy_batch_with_nothing_to_apply():
    """A graph's replay leaves each row's argmax (`greedy_ids`) beside the logits. `_sample` takes it as the tokens only
    when every row is greedy and no logits processor changes the logits; otherwise the sampler runs on the logits.
    The 'argmax' handed in here is deliberately not the logits' argmax, so the test sees which path was taken."""
    from types import SimpleNamespace

    import numpy as np

    with LLM(TINY_MODEL_PATH, **CPU_ENGINE) as llm:
        runner, vocab = llm.llm_engine.executor.runner, llm.llm_engine.config.hf_config.vocab_size
        logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
        argmax = logits.argmax(dim=-1)
        recorded = (argmax + 1) % vocab  # a stand-in the sampler would never pick
        cases = {
            "greedy": [SamplingParams(temperature=0)] * 2,
            "one random row": [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1)],
            "a penalty": [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.5)],
        }
        for k, (name, params) in enumerate(cases.items()):
            ids = np.array([100 + 2 * k, 101 + 2 * k])
            for seq_id, p in zip(ids.tolist(), params):
                runner.add_request(seq_id, p, [5, 6, 7])
            step = SimpleNamespace(seq_ids=ids, grammar=None)
            took = runner._sample(logits.clone(), step, recorded).token_ids
            eager = runner._sample(logits.clone(), step, None).token_ids  # an eager step: no recorded pick
            if name == "greedy":
                assert took is recorded and took.tolist() == recorded.tolist(), name
                assert eager.tolist() == argmax.tolist(), name
            else:
                assert took.tolist() != recorded.tolist() and took[0] == argmax[0], name
                assert took[0] == eager[0], name
        only = int(recorded[1])  # a structured-outputs mask on row 1 that allows one token: the sampler must run
        bitmask = np.full((2, (vocab + 31) // 32), -1, dtype=np.int32)
        bitmask[1] = 0
        bitmask[1, only // 32] = np.int32(np.uint32(1 << (only % 32)).view(np.int32))
        step = SimpleNamespace(seq_ids=np.array([100, 101]), grammar=lambda: (bitmask, [1]))
        took = runner._sample(logits.clone(), step, recorded).token_ids
        assert took.tolist() == [int(argmax[0]), only]
