"""End to end: greedy generation token-identical to transformers' `generate`, on CPU (the tiny model) and on a GPU
(the Qwen3-0.6B architecture with random weights, float32), with prefix caching on and off, under preemption, with
chunked prefill, and with CUDA graphs against eager execution."""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, SamplingParams, TINY_MODEL_PATH

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n        ",
           "for i in range(10):\n", "    return", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "x", "try:\n    import json\nexcept ImportError:\n    json = None\n\n\ndef load(path):\n"]
MAX_TOKENS = 24


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    "transformers' generate, one prompt at a time (no padding), greedy; stops at eos like the engine does."
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
        out.append(y[0, len(ids):].tolist())
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
            assert engine.stats.num_steps > MAX_TOKENS + 2   # prompts took several steps each
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not engine.requests


def test_prefix_cache_is_hit_and_outputs_do_not_change(tiny_reference):
    ids, reference = tiny_reference
    shared = ids[7] * 3   # 3 copies of the longest prompt: at least 2 full blocks of 16
    with LLM(TINY_MODEL_PATH, max_model_len=256) as llm:
        first = llm.generate([shared], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        second = llm.generate([shared], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(shared) - 1) // 16 * 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


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
    hf.generation_config.eos_token_id = None   # the engine runs with ignore_eos: 64 tokens each
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


# ---- cascade decode: a prefix shared by the whole batch is read once (notebook 05) ------------------------------

def _generate_with_shared_prefix(ids, monkeypatch, **kwargs):
    "Cache a shared prefix with one request, then decode 5 requests that start with it; thresholds lowered to fit."
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.kernels import cascade
    monkeypatch.setattr(cascade, "CASCADE_MIN_PREFIX", 16)
    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED", 16)
    used, original = [], ModelRunner.shared_prefix

    def spy(self, x):
        value = original(self, x)
        used.append(0 if value is None else int(value[0]))
        return value
    monkeypatch.setattr(ModelRunner, "shared_prefix", spy)
    shared = ids[7] + ids[0] + ids[2]
    prompts = [shared + tail for tail in ids[:5]]
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(TINY_MODEL_PATH, max_model_len=256, **kwargs) as llm:
        llm.generate([shared], params, use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = llm.llm_engine.model_runner.graphs
        if graphs is not None:   # on a GPU: the decode steps replay the graphs that read the prefix once
            used.append(int(graphs.host_inputs[graphs.turn ^ 1]["shared_prefix_len"][0]))   # the last replay's
    return [o.outputs[0].token_ids for o in outs], used, len(shared)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the Triton kernels (interpreter)")
def test_cascade_decode_on_cpu_gives_the_tokens_of_plain_attention(tiny_reference, monkeypatch):
    ids, _ = tiny_reference
    got, used, n = _generate_with_shared_prefix(ids, monkeypatch, device="cpu", attention_backend="triton")
    assert max(used) == (n - 1) // 16 * 16 > 0   # the decode steps of the 5 requests read the prefix once
    with LLM(TINY_MODEL_PATH, max_model_len=256, device="cpu", attention_backend="torch") as llm:
        want = llm.generate([ids[7] + ids[0] + ids[2] + tail for tail in ids[:5]],
                            SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in want]


@pytest.mark.gpu
def test_gpu_cascade_decode_with_cuda_graphs_gives_the_tokens_of_eager_plain_attention(tiny_reference, monkeypatch):
    ids, _ = tiny_reference
    got, used, n = _generate_with_shared_prefix(ids, monkeypatch, dtype="float32")
    assert used[-1] == (n - 1) // 16 * 16 > 0
    with LLM(TINY_MODEL_PATH, max_model_len=256, dtype="float32", enable_prefix_caching=False) as llm:
        want = llm.generate([ids[7] + ids[0] + ids[2] + tail for tail in ids[:5]],
                            SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in want]
