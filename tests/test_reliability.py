"""What the engine does when things go wrong (project issue 8): bad requests, broken model folders, a KV cache under
pressure, faults in the middle of a step, and closing.

The contract tested here:
- a bad request is refused before any work is admitted: the error (TypeError for a wrong type, ValueError for a wrong
  value) names the request (`prompt 3`) and the field; the engine holds no request and every KV block is free
  afterwards, and the next call works;
- a broken model folder or engine argument fails at construction, with a message that says what to fix;
- a KV cache that holds only a few sequences gives the same greedy tokens as a large one (preemption and recompute),
  and counts its preemptions in `engine.stats.num_preemptions`;
- an exception or a KeyboardInterrupt inside a step leaves the engine clean and usable, with the same outputs after;
- `close()` (or `with LLM(...)`, or `del llm`) releases the model and the KV cache.
Everything runs on the embedded tiny Qwen3 on a CPU; the one GPU test measures device memory around `close()`.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import shutil
import weakref

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.engine.kv_cache import kv_block_bytes
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sequence import Sequence
from minivllm.models.registry import load_config

HF_CONFIG = load_config(TINY_MODEL_PATH)
VOCAB = HF_CONFIG.vocab_size
MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8)
GOOD = ["def fibonacci(n):\n    ", [5, 6, 7, 8], {"prompt": "import os\n"}, {"prompt_token_ids": [9, 10, 11]}]


def cpu_llm(model: str = TINY_MODEL_PATH, **kwargs) -> LLM:
    "An LLM on the CPU, on a GPU machine too: these tests are about the engine's logic; float32 CPU runs are exact."
    return LLM(model, **{"device": "cpu", **kwargs})


@pytest.fixture(scope="module")
def llm():
    with cpu_llm(TINY_MODEL_PATH, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, num_kvcache_blocks=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(llm):
    "The good batch's greedy tokens, from the engine before anything went wrong."
    return token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False))


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_clean(engine: LLMEngine) -> None:
    "No request left anywhere, every KV block free, the bookkeeping consistent."
    scheduler, bm = engine.scheduler, engine.scheduler.block_manager
    assert engine.requests == {} and engine.outputs.by_seq == {}
    assert not scheduler.waiting and not scheduler.running and not scheduler.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks == engine.executor.num_blocks == engine.executor.runner.num_blocks
    sampling = engine.executor.runner.sampling
    assert sampling.generators == {} and sampling.params == {}  # no seeded generator (or params) of a dead request
    scheduler.check_invariants()


def assert_works(llm: LLM, expected) -> None:
    assert token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False)) == expected
    assert_clean(llm.llm_engine)


# ---- 1. validation: a bad request rejects the whole call, before anything runs -----------------------------------
BAD_PROMPTS = [
    (["ok", ""], ValueError, "prompt 1 is empty"),
    ([[1, 2], [3, -1]], ValueError, r"prompt 1: token id -1 is outside the vocabulary \[0, " + str(VOCAB)),
    ([[1, 2], [3, VOCAB]], ValueError, rf"prompt 1: token id {VOCAB} is outside the vocabulary"),
    (["ok", 3.14], TypeError, "prompt 1 must be a string, a list of token ids or a prompt dict, got float"),
    (3.14, TypeError, "prompts must be a string, a list of token ids, a prompt dict or a list of these"),
    ([[1, "2"]], TypeError, "prompt 0: token ids must be ints, got str '2'"),
    ([1, "2"], TypeError, "prompt 0: token ids must be ints, got str '2'"),  # one prompt of token ids
    ([[1.0, 2.0]], TypeError, "prompt 0: token ids must be ints, got float 1.0"),
    ([[True, 2]], TypeError, "prompt 0: token ids must be ints, got bool True"),
    (["ok", {"text": "hi"}], TypeError, r"prompt 1: a prompt dict holds exactly one of 'prompt' or 'prompt_token_ids'"),
    ([{"prompt": "a", "prompt_token_ids": [1]}], TypeError, "prompt 0: a prompt dict holds exactly one of"),
    ([{"prompt": [1, 2]}], TypeError, "prompt 0: 'prompt' must be a string, got list"),
    ([{"prompt_token_ids": "hi"}], TypeError, "prompt 0: 'prompt_token_ids' must be a list of token ids, got str"),
    (
        ["ok", [7] * MAX_MODEL_LEN],
        ValueError,
        rf"prompt 1 has {MAX_MODEL_LEN} tokens; with max_model_len={MAX_MODEL_LEN} a prompt may have at most "
        rf"{MAX_MODEL_LEN - 1}",
    ),
    (["ok", "x = 1\n" * 100], ValueError, rf"prompt 1 has \d+ tokens; with max_model_len={MAX_MODEL_LEN}"),
]


@pytest.mark.parametrize("prompts, error, message", BAD_PROMPTS)
def test_bad_prompt_rejects_the_call_and_nothing_runs(llm, expected, prompts, error, message):
    steps = llm.llm_engine.stats.num_steps
    with pytest.raises(error, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats.num_steps == steps  # not one step ran
    assert_clean(llm.llm_engine)
    assert_works(llm, expected)


# Every invalid SamplingParams value: (field, value, error). The same table as test_sampling_params.py, plus the two
# limits the engine adds (a seed and a top_k must fit in 64 bits).
BAD_PARAMS = [
    ("temperature", -0.1, ValueError),
    ("temperature", float("nan"), ValueError),
    ("temperature", float("inf"), ValueError),
    ("temperature", "0.5", TypeError),
    ("temperature", True, TypeError),
    ("top_p", 0.0, ValueError),
    ("top_p", 1.5, ValueError),
    ("top_k", -2, ValueError),
    ("top_k", 2.0, TypeError),
    ("min_p", -0.1, ValueError),
    ("min_p", 1.1, ValueError),
    ("max_tokens", 0, ValueError),
    ("max_tokens", 1.5, TypeError),
    ("seed", "42", TypeError),
    ("ignore_eos", 1, TypeError),
    ("stop", [""], TypeError),
    ("stop", [1], TypeError),
    ("stop_token_ids", [1, -2], ValueError),
    ("stop_token_ids", 5, TypeError),
    ("logprobs", -1, ValueError),
    ("logprobs", 0.5, TypeError),
]
ENGINE_LIMITS = [("seed", 2**64, ValueError), ("seed", -(2**63) - 1, ValueError), ("top_k", 2**63, ValueError)]


@pytest.mark.parametrize("field, value, error", BAD_PARAMS)
def test_sampling_params_refuse_bad_values_when_made(field, value, error):
    with pytest.raises(error, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value, error", BAD_PARAMS + ENGINE_LIMITS)
def test_bad_sampling_params_reject_the_call(llm, expected, field, value, error):
    "A SamplingParams changed after it was made (or beyond the engine's limits) is caught when the call starts."
    bad = SamplingParams(temperature=0, max_tokens=4)
    object.__setattr__(bad, field, value)
    with pytest.raises(error, match=rf"prompt 2: SamplingParams\.{field}"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY, bad], use_tqdm=False)
    assert_clean(llm.llm_engine)
    assert_works(llm, expected)


@pytest.mark.parametrize(
    "params, error, message",
    [
        ([GREEDY], ValueError, "got 1 SamplingParams for 2 prompts: pass one, or exactly one per prompt"),
        ([GREEDY] * 3, ValueError, "got 3 SamplingParams for 2 prompts"),
        ({"temperature": 0}, TypeError, "sampling_params must be a SamplingParams or a list of them, got dict"),
        ([GREEDY, {"temperature": 0}], TypeError, "prompt 1: sampling params must be a SamplingParams, got dict"),
        ("greedy", TypeError, "sampling_params must be a SamplingParams or a list of them, got str"),
        (0.0, TypeError, "sampling_params must be a SamplingParams or a list of them, got float"),
    ],
)
def test_bad_params_list_rejects_the_call(llm, expected, params, error, message):
    with pytest.raises(error, match=message):
        llm.generate(["a", "b"], params, use_tqdm=False)
    assert_clean(llm.llm_engine)
    assert_works(llm, expected)


def test_params_are_copied_when_accepted(llm):
    "Changing a SamplingParams after the call started cannot reach the running request."
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5)
    request_id = engine.add_request(None, [1, 2, 3], params)
    params.max_tokens = 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == [request_id] and len(outputs[0].outputs[0].token_ids) == 5
    assert_clean(engine)


def test_engine_add_request_validates_too(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="request 'r1' is empty"):
        engine.add_request("r1", [])
    with pytest.raises(TypeError, match="request: sampling params must be a SamplingParams, got dict"):
        engine.add_request(None, "x", {"temperature": 0})
    engine.add_request("r1", "x", GREEDY)
    with pytest.raises(ValueError, match="request id 'r1' is already in use"):
        engine.add_request("r1", "y", GREEDY)
    engine.abort_request("r1")
    assert_clean(engine)


def test_generate_ids_do_not_collide_with_callers_ids(llm, expected):
    "A caller's own request id that looks like an automatic one ('0', '1', ...) is skipped, not a failure."
    engine = llm.llm_engine
    probe = engine.add_request(None, [1], GREEDY)  # the next automatic id
    engine.abort_request(probe)
    taken = [
        engine.add_request(str(int(probe) + i), [1, 2], SamplingParams(temperature=0, max_tokens=1))
        for i in range(1, 6)
    ]
    outputs = llm.generate(GOOD, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected and not {o.request_id for o in outputs} & set(taken)
    assert_clean(engine)  # the caller's requests ran too (one token each) and left


def test_longest_prompt_generates_exactly_one_token(llm):
    "A prompt may have max_model_len - 1 tokens (one is left to generate); the engine's add_request agrees."
    out = llm.generate(
        [[7] * (MAX_MODEL_LEN - 1)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    engine = llm.llm_engine
    with pytest.raises(
        ValueError,
        match=f"request has {MAX_MODEL_LEN} tokens; with max_model_len={MAX_MODEL_LEN} "
        f"a prompt may have at most {MAX_MODEL_LEN - 1}",
    ):
        engine.add_request(None, [7] * MAX_MODEL_LEN, GREEDY)
    assert_clean(engine)


@pytest.mark.parametrize("max_tokens", [MAX_MODEL_LEN, 10**9, None])
def test_generation_stops_at_max_model_len(llm, max_tokens):
    """prompt + max_tokens beyond max_model_len: exactly max_model_len - prompt_len tokens, finish_reason 'length'.
    The three prompt lengths go in one call (each request is capped on its own; one call costs one request's steps)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt_lens = [1, 20, MAX_MODEL_LEN - 2]
    outs = llm.generate([list(range(1, n + 1)) for n in prompt_lens], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [MAX_MODEL_LEN - n for n in prompt_lens]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_clean(llm.llm_engine)


def test_chat_refuses_what_is_not_a_conversation(llm):
    with pytest.raises(TypeError, match="chat\\(\\) takes a conversation"):
        llm.chat("Hi", GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="conversation 1 is"):
        llm.chat([[{"role": "user", "content": "Hi"}], "Hi"], GREEDY, use_tqdm=False)
    assert_clean(llm.llm_engine)


# ---- 2. construction errors that say what to fix ---------------------------------------------------------------------
def model_copy(tmp_path, name: str = "model") -> str:
    folder = tmp_path / name
    shutil.copytree(TINY_MODEL_PATH, folder)
    return str(folder)


def edit_weights(folder: str, edit) -> None:
    "Apply `edit` to the checkpoint's tensors (a dict) and save them back."
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def a_weight(tensors: dict, part: str = "q_proj") -> str:
    return next(name for name in sorted(tensors) if f".{part}." in name)


def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(ValueError, match="model path '.*nowhere' is not a folder"):
        cpu_llm(str(tmp_path / "nowhere"))


def test_folder_without_config(tmp_path):
    folder = model_copy(tmp_path)
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(ValueError, match="has no config.json: not a Hugging Face model folder"):
        cpu_llm(folder)


def test_config_that_is_not_json(tmp_path):
    folder = model_copy(tmp_path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="config.json in .* is not a JSON object"):
        cpu_llm(folder)


@pytest.mark.parametrize("field,value", [("num_attention_heads", "8"), ("head_dim", None), ("num_hidden_layers", 0)])
def test_config_with_a_bad_field(tmp_path, field, value):
    "transformers' own checks raise their own classes (huggingface_hub's StrictDataclass...Error): a ValueError here."
    folder = model_copy(tmp_path)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config | {field: value}, f)
    with pytest.raises(ValueError, match=f"(?s)config.json in .* is not a valid qwen3 config: .*{field}"):
        cpu_llm(folder)


def test_folder_of_another_architecture(tmp_path):
    folder = model_copy(tmp_path)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    json.dump(config, open(path, "w"))
    with pytest.raises(ValueError, match="holds a model of type 'gpt2'; minivllm runs qwen3, qwen2, llama, qwen3_moe"):
        cpu_llm(folder)


def test_missing_tensor(tmp_path):
    folder = model_copy(tmp_path)
    removed = []
    edit_weights(folder, lambda t: removed.append(a_weight(t)) or t.pop(removed[0]))
    with pytest.raises(ValueError, match=f"the checkpoint is missing 1 tensor\\(s\\) the model needs: {removed[0]}"):
        cpu_llm(folder)


def test_tensor_of_the_wrong_shape(tmp_path):
    folder = model_copy(tmp_path)
    name = a_weight(load_file(os.path.join(folder, "model.safetensors")), "down_proj")

    def shrink(t):
        t[name] = t[name][:-1].clone()

    edit_weights(folder, shrink)
    rows, cols = load_file(os.path.join(TINY_MODEL_PATH, "model.safetensors"))[name].shape
    with pytest.raises(
        ValueError,
        match=rf"tensor {name}: expected shape \[{rows}, {cols}\], found \[{rows - 1}, "
        rf"{cols}\]",
    ):
        cpu_llm(folder)


def test_extra_tensor(tmp_path):
    folder = model_copy(tmp_path)
    edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(
        ValueError,
        match="unexpected tensor model.layers.0.mlp.extra_proj.weight in the checkpoint: "
        "Qwen3ForCausalLM has no such parameter",
    ):
        cpu_llm(folder)


@pytest.mark.parametrize("damage", ["truncated", "header cut", "zeros", "no file"])
def test_corrupt_safetensors(tmp_path, damage):
    folder = model_copy(tmp_path)
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    if damage == "no file":
        os.remove(path)
        with pytest.raises(ValueError, match="no \\*.safetensors files in"):
            cpu_llm(folder)
        return
    damaged = {"truncated": data[: len(data) // 2], "header cut": data[:5], "zeros": bytes(100)}[damage]
    open(path, "wb").write(damaged)
    with pytest.raises(ValueError, match="cannot read model.safetensors: it is not a complete safetensors file"):
        cpu_llm(folder)


def test_missing_tokenizer_says_so_and_token_ids_still_work(tmp_path):
    folder = model_copy(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(folder, name))
    with pytest.raises(
        ValueError,
        match="no tokenizer in .*: none of tokenizer.json, tokenizer.model, vocab.json.*"
        "or pass skip_tokenizer_init=True and give prompts as token ids",
    ):
        cpu_llm(folder)
    with cpu_llm(folder, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN) as llm:
        out = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text == "" and out.prompt is None
        with pytest.raises(ValueError, match="prompt 0 is text, but the engine has no tokenizer"):
            llm.generate(["text"], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="chat\\(\\) needs a tokenizer"):
            llm.chat([{"role": "user", "content": "Hi"}])
        assert_clean(llm.llm_engine)


def test_tokenizer_of_another_model(tmp_path):
    "A tokenizer with more tokens than the model's vocabulary belongs to some other model."
    folder = model_copy(tmp_path)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config["vocab_size"] = 1000
    json.dump(config, open(path, "w"))
    with pytest.raises(ValueError, match=f"has {VOCAB} tokens, the model only 1000: they do not belong together"):
        cpu_llm(folder)


def test_kv_cache_too_small_says_how_much_is_needed():
    block_bytes = kv_block_bytes(HF_CONFIG, 16, torch.float32)
    blocks_per_seq = math.ceil(256 / 16)
    need = f"needs {blocks_per_seq} blocks \\({blocks_per_seq * block_bytes / 2**20:.1f} MiB\\)"
    with pytest.raises(
        ValueError,
        match="the KV cache holds 2 blocks of 16 tokens = 32 tokens, but one sequence of "
        f"max_model_len=256 tokens {need}",
    ):
        cpu_llm(TINY_MODEL_PATH, max_model_len=256, num_kvcache_blocks=2)
    space = (blocks_per_seq - 0.5) * block_bytes / 2**30  # half a block short of one sequence
    with pytest.raises(ValueError, match=f"holds {blocks_per_seq - 1} blocks .* {need}. Give the cache more memory"):
        cpu_llm(TINY_MODEL_PATH, max_model_len=256, cpu_kvcache_space_gib=space)


def test_dtype_the_device_cannot_run(monkeypatch):
    "The message path, on a CPU that can in fact run every dtype: the device's test matmul is made to fail."
    real_ones = torch.ones

    def ones(*args, dtype=None, **kwargs):
        if dtype == torch.float16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")
        return real_ones(*args, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch, "ones", ones)
    with pytest.raises(ValueError, match="the cpu device cannot run dtype float16: .*not implemented for 'Half'"):
        cpu_llm(TINY_MODEL_PATH, dtype="float16")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dtype="fp8"), ValueError, "dtype must be 'auto' or one of float32, bfloat16, float16, got 'fp8'"),
        (dict(dtype=torch.float16), TypeError, "dtype must be a string, got torch.float16"),
        (dict(device="tpu"), ValueError, "device must be 'auto', 'cpu' or 'cuda', got 'tpu'"),
        (dict(max_num_seqs="8"), TypeError, "max_num_seqs must be an int, got str '8'"),
        (
            dict(max_model_len=10**6),
            ValueError,
            r"max_model_len must be in \[1, \d+\] \(the model's "
            r"max_position_embeddings\)",
        ),
        (dict(block_size=12), ValueError, "block_size must be a power of two"),
        (
            dict(seed=2**70),
            ValueError,
            "seed must fit in 64 bits",
        ),  # (torch's own: "Overflow when unpacking long long")
        (
            dict(num_kvcache_blocks=10**9),
            ValueError,
            r"a KV cache of 1,000,000,000 blocks \(.* GiB\) does not fit in cpu "
            r"memory .*: lower num_kvcache_blocks",
        ),  # (an OSError of mmap's)
        (dict(foo=1, max_num_seq=3), TypeError, "unknown engine argument\\(s\\) foo, max_num_seq; known: "),
    ],
)
def test_bad_engine_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        cpu_llm(TINY_MODEL_PATH, **kwargs)


@pytest.mark.gpu
def test_gpu_without_bfloat16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match="this GPU cannot run bfloat16: pass dtype='float16' or dtype='float32'"):
        LLM(TINY_MODEL_PATH, device="cuda", dtype="bfloat16")


# ---- 3. memory pressure: preemption gives the same tokens -------------------------------------------------------
def test_small_kv_cache_preempts_and_gives_the_same_tokens():
    "120 requests through a cache that holds 3 full sequences: same greedy tokens as a roomy cache, all blocks back."
    rng = random.Random(8)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(120)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5) for _ in prompts
    ]
    common = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=256)
    with cpu_llm(TINY_MODEL_PATH, num_kvcache_blocks=256, **common) as roomy:
        reference = token_ids(roomy.generate(prompts, params, use_tqdm=False))
        assert roomy.llm_engine.stats.num_preemptions == 0
    with cpu_llm(TINY_MODEL_PATH, num_kvcache_blocks=3 * MAX_MODEL_LEN // 16, **common) as small:
        outputs = small.generate(prompts, params, use_tqdm=False)
        engine = small.llm_engine
        assert token_ids(outputs) == reference
        assert all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
        assert engine.stats.num_preemptions == engine.scheduler.num_preemptions > 20
        assert_clean(engine)


# ---- 4. faults inside a step --------------------------------------------------------------------------------------
def runner_step(engine: LLMEngine) -> tuple[ModelRunner, str]:
    "The runner method the engine calls (through its executor) once per step: `collect` (of a launched step)."
    return engine.executor.runner, "collect"


def fail_once(monkeypatch, obj, name: str, exc: type[BaseException], after: int = 2):
    "Make `obj.name` raise a new `exc` on its call number `after + 1` (only then)."
    real, calls = getattr(obj, name), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise exc("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["runner", "model.forward", "scheduler.postprocess"])
def test_fault_in_a_step_leaves_the_engine_usable(llm, expected, monkeypatch, exc, where):
    engine = llm.llm_engine
    owner, name = {
        "runner": runner_step(engine),
        "model.forward": (engine.executor.runner.model, "forward"),
        "scheduler.postprocess": (engine.scheduler, "postprocess"),
    }[where]
    calls = fail_once(monkeypatch, owner, name, exc)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8)  # a request with its own generator
    gc.collect()
    before = [o for o in gc.get_objects() if type(o) is Sequence]  # (kept alive: their ids stay theirs)
    with pytest.raises(exc, match="injected fault"):
        llm.generate(GOOD + [[1, 2, 3]], [GREEDY] * len(GOOD) + [seeded], use_tqdm=False)
    assert calls[0] == 3
    assert_clean(engine)
    gc.collect()  # and nothing holds the aborted sequences any more
    old = {id(o) for o in before}
    assert not [o for o in gc.get_objects() if type(o) is Sequence and id(o) not in old]
    del before
    assert_works(llm, expected)


def test_fault_in_a_stream_leaves_the_engine_usable(llm, expected, monkeypatch):
    fail_once(monkeypatch, *runner_step(llm.llm_engine), RuntimeError)
    with pytest.raises(RuntimeError, match="injected fault"):
        list(llm.stream("def f():", SamplingParams(temperature=0, max_tokens=10)))
    assert_clean(llm.llm_engine)
    assert_works(llm, expected)


@pytest.mark.parametrize("num_deltas", [1, 4])
def test_stream_stopped_early_frees_its_request(llm, expected, num_deltas):
    stream = llm.stream("def f():", SamplingParams(temperature=0, max_tokens=10))
    deltas = [next(stream) for _ in range(num_deltas)]
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == num_deltas and not deltas[-1].finished
    stream.close()
    assert_clean(llm.llm_engine)
    assert_works(llm, expected)
    engine = llm.llm_engine  # and stepping by hand works too
    request_id = engine.add_request(None, GOOD[1], GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == [request_id] and outputs[0].outputs[0].token_ids == expected[1]
    assert_clean(engine)


@pytest.mark.parametrize("abort_after", [1, 2, 5])
def test_abort_while_running(llm, expected, abort_after):
    "A request aborted between steps leaves at once; the others go on to the same tokens."
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, GREEDY) for p in GOOD]
    victim = engine.add_request(None, [1, 2, 3], SamplingParams(temperature=0, max_tokens=20))
    done = {}
    for step in range(1000):
        if step == abort_after:
            engine.abort_request(victim)
            assert victim not in engine.requests
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished_requests():
            break
    assert victim not in done and token_ids(done[i] for i in ids) == expected
    assert_clean(engine)


def test_an_aborted_id_is_free_at_once_with_a_step_in_flight(llm, expected):
    "abort_request frees the id before it returns, a step launched ahead or not: the same id again gets its own tokens."
    engine = llm.llm_engine
    for steps in (1, 2, 3):
        engine.add_request("again", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20))
        for _ in range(steps):
            engine.step()
        engine.abort_request("again")
        assert "again" not in engine.requests
        engine.add_request("again", GOOD[1], GREEDY)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in done] == ["again"] and done[0].outputs[0].token_ids == expected[1]
        assert_clean(engine)


def test_abort_takes_one_id_or_a_list(llm, expected):
    "vLLM's abort_request takes a request id or a list of them; ids that are unknown or already ended are ignored."
    engine = llm.llm_engine
    keep = engine.add_request(None, GOOD[0], GREEDY)
    victims = [
        engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=20)) for p in ([1, 2, 3], [4, 5], [6])
    ]
    engine.step()
    engine.abort_request(victims[:2] + ["no such request", victims[0]])
    engine.abort_request(victims[2])
    assert not set(victims) & set(engine.requests) and keep in engine.requests
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(done) == [keep] and done[keep].outputs[0].token_ids == expected[0]
    assert_clean(engine)


@pytest.mark.parametrize("stop", [[")\n"], ["getn", ")\n"], ["\n    f"], None])
def test_stream_never_shows_part_of_a_stop_string(llm, stop):
    "A stop string cut across tokens: the stream holds back its start, so the deltas add up to generate's text."
    prompt, params = "def fibonacci(n):\n    ", SamplingParams(temperature=0, max_tokens=16, stop=stop)
    whole = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    deltas = [out.outputs[0] for out in llm.stream(prompt, params)]
    assert "".join(d.text for d in deltas) == whole.text
    assert sum((d.token_ids for d in deltas), []) == whole.token_ids
    assert deltas[-1].finish_reason == whole.finish_reason and deltas[-1].stop_reason == whole.stop_reason
    assert_clean(llm.llm_engine)


def test_step_can_be_retried_after_a_fault(llm, expected, monkeypatch):
    "Driving LLMEngine by hand: a failed step keeps the requests; the next step() carries on from where it was."
    engine = llm.llm_engine
    fail_once(monkeypatch, *runner_step(engine), RuntimeError, after=3)
    ids = [engine.add_request(None, p, GREEDY) for p in GOOD]
    done, faults = {}, 0
    while engine.has_unfinished_requests():
        try:
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        except RuntimeError:
            faults += 1
            engine.scheduler.check_invariants()
    assert faults == 1 and token_ids(done[i] for i in ids) == expected
    assert_clean(engine)


def test_fault_keeps_the_callers_own_requests(llm, expected, monkeypatch):
    "generate() aborts only its own requests; one queued with add_request stays, and can still finish."
    engine = llm.llm_engine
    mine = engine.add_request("mine", [1, 2, 3], GREEDY)
    fail_once(monkeypatch, *runner_step(engine), KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(GOOD, GREEDY, use_tqdm=False)
    assert list(engine.requests) == [mine]
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [mine]
    assert_clean(engine)
    assert_works(llm, expected)


# ---- 4b. closing releases the model and the KV cache ------------------------------------------------------------
def model_refs(llm: LLM) -> tuple[weakref.ref, weakref.ref]:
    runner = llm.llm_engine.executor.runner
    return weakref.ref(runner.model), weakref.ref(runner.kv_cache)


def test_close_releases_model_and_kv_cache():
    llm = cpu_llm(TINY_MODEL_PATH, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16)
    llm.generate(GOOD, GREEDY, use_tqdm=False)
    model, kv_cache = model_refs(llm)
    llm.close()
    gc.collect()
    assert model() is None and kv_cache() is None
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate(GOOD, GREEDY, use_tqdm=False)
    llm.close()  # twice is fine


def test_context_manager_and_del_release_the_model():
    with cpu_llm(TINY_MODEL_PATH, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16) as llm:
        llm.generate(GOOD, GREEDY, use_tqdm=False)
        refs = model_refs(llm)
    gc.collect()
    assert all(r() is None for r in refs) and llm.llm_engine is None
    llm = cpu_llm(TINY_MODEL_PATH, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16)
    llm.generate(GOOD, GREEDY, use_tqdm=False)
    refs = model_refs(llm)
    del llm
    gc.collect()
    assert all(r() is None for r in refs)


def test_close_returns_the_kv_cache_memory_to_the_system():
    "RSS of this process: a 256 MiB KV cache, touched, then closed: the memory goes back."

    def rss():
        return psutil.Process().memory_info().rss

    size_gib = 0.25
    llm = cpu_llm(TINY_MODEL_PATH, max_model_len=256, cpu_kvcache_space_gib=size_gib)
    kv = llm.llm_engine.executor.runner.kv_cache
    assert kv.numel() * kv.element_size() == pytest.approx(size_gib * 2**30, rel=0.01)
    kv.fill_(0)  # on a CPU the cache's pages are only real once written
    del kv
    gc.collect()
    before = rss()
    llm.close()
    gc.collect()
    assert before - rss() > 0.9 * size_gib * 2**30


def test_failed_construction_leaves_nothing_behind(monkeypatch):
    "An error after the runner was built (here: the scheduler's) closes the runner before it propagates."
    closed = []
    import minivllm.engine.llm_engine as llm_engine

    class BrokenScheduler:
        def __init__(self, *args, **kwargs):
            raise ValueError("broken scheduler")

    real_close = ModelRunner.close
    monkeypatch.setattr(llm_engine, "Scheduler", BrokenScheduler)
    monkeypatch.setattr(ModelRunner, "close", lambda self: closed.append(self) or real_close(self))
    with pytest.raises(ValueError, match="broken scheduler"):
        cpu_llm(TINY_MODEL_PATH, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16)
    assert len(closed) == 1 and closed[0].model is None and closed[0].kv_cache is None


@pytest.mark.gpu
def test_gpu_memory_returns_after_close():
    """Device memory before an LLM is made and after it is closed: the same (allocator) and within 256 MiB (the
    driver's view), three times over. A first LLM warms up what is made once per process (CUDA context, cuBLAS
    workspace, compiled kernels)."""
    num_blocks, block_size = 16384, 16
    kwargs = dict(
        device="cuda", dtype="bfloat16", max_model_len=256, block_size=block_size, num_kvcache_blocks=num_blocks
    )
    kv_bytes = num_blocks * kv_block_bytes(HF_CONFIG, block_size, torch.bfloat16)  # 1 GiB on the tiny model

    def settle():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]

    with LLM(TINY_MODEL_PATH, **kwargs) as llm:
        expected = token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False))
    base_allocated, base_free = settle()
    for close in ("close", "with", "del"):
        llm = LLM(TINY_MODEL_PATH, **kwargs)
        assert torch.cuda.memory_allocated() - base_allocated >= kv_bytes
        assert base_free - torch.cuda.mem_get_info()[0] >= kv_bytes
        if close == "with":
            with llm:
                assert token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False)) == expected
        else:
            assert token_ids(llm.generate(GOOD, GREEDY, use_tqdm=False)) == expected
            llm.close() if close == "close" else None
        del llm
        allocated, free = settle()
        assert allocated - base_allocated <= 2**20, (close, allocated - base_allocated)
        assert base_free - free <= 256 * 2**20, (close, base_free - free)
