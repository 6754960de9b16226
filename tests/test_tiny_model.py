"""Checks of the tiny Qwen3 model embedded in minivllm (``minivllm/data/tiny-qwen3``).

The folder is made by ``tools/train_tiny_qwen3.py``.  These tests run offline
on CPU: they check the folder's format, that ``transformers`` loads it, that
the tokenizer and chat template work, and that the model is actually good:
its cross-entropy on held-out standard-library code must be at most 60% of
the best unigram model's on the same tokens (the unigram distribution is fit
on those evaluated tokens themselves, which is stricter than fitting it on
the training split), its bits per byte must beat the model it replaced, and
it must answer held-out requests with code (issue 18: the figures on the
whole held-out split and all 100 requests are the script's ``eval``; these
are their cheap CPU parts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

MAX_FOLDER_BYTES = 32 * 1024 * 1024  # issue 18: the embedded model stays within 32 MB
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
MAX_RATIO_TO_UNIGRAM = 0.6
MAX_RATIO_TO_PREVIOUS = 0.85  # bits per byte against the 5.0M model's on the same tokens: issue 18's -15%
ANSWER_REQUESTS = 20  # the first of the eval's 100 held-out requests (~20 s on CPU)
MIN_ANSWER_SHARE = 0.6  # issue 18's target

CODE_SNIPPET = '''import os


def greet(name: str) -> str:
\t"""Say hello — en français: « salut »."""
    if not name:\r\n        raise ValueError("empty")  # 🐍
    return f"Hello, {name}!" * 2
'''


@pytest.fixture(scope="module")
def model_path() -> Path:
    from minivllm.tiny_model import TINY_MODEL_PATH

    return Path(TINY_MODEL_PATH)


@pytest.fixture(scope="module")
def config(model_path: Path) -> dict:
    return json.loads((model_path / "config.json").read_text())


@pytest.fixture(scope="module")
def model(model_path: Path):
    return AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_path: Path):
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def test_folder_has_required_files_and_is_small(model_path: Path) -> None:
    assert model_path.is_dir(), f"{model_path} is missing: run tools/train_tiny_qwen3.py"
    for name in REQUIRED_FILES:
        assert (model_path / name).is_file(), f"{name} missing from {model_path}"
    size = sum(p.stat().st_size for p in model_path.rglob("*") if p.is_file())
    assert size <= MAX_FOLDER_BYTES, f"{model_path} is {size / 2**20:.1f} MiB"


def test_weights_are_bf16_and_tied_weights_saved_once(model_path: Path) -> None:
    with safe_open(model_path / "model.safetensors", framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes and set(dtypes.values()) == {"BF16"}, dtypes
    assert "model.embed_tokens.weight" in dtypes
    assert "lm_head.weight" not in dtypes  # tied to the embedding
    assert "model.layers.0.self_attn.q_norm.weight" in dtypes
    assert "model.layers.0.self_attn.k_norm.weight" in dtypes


def test_config_keeps_what_makes_qwen3_qwen3(config: dict) -> None:
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["num_attention_heads"] * config["head_dim"] != config["hidden_size"]
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert isinstance(config["eos_token_id"], int)


def test_model_loads_offline_with_tied_embeddings(model, config: dict) -> None:
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    eos = model.generation_config.eos_token_id  # one id, or a list (a chat model also stops at <|im_end|>)
    assert config["eos_token_id"] in (eos if isinstance(eos, list) else [eos])


def test_tokenizer_special_tokens(tokenizer, config: dict) -> None:
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert tokenizer.pad_token == "<|endoftext|>"
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(token)) == 1, token
    assert len(tokenizer) == config["vocab_size"]


def test_tokenizer_round_trips_code(tokenizer, model_path: Path) -> None:
    from tokenizers import Tokenizer

    ids = tokenizer.encode(CODE_SNIPPET)
    assert tokenizer.decode(ids) == CODE_SNIPPET
    # transformers must use tokenizer.json as is (no added BOS, no swapped pre-tokenizer).
    assert ids == Tokenizer.from_file(str(model_path / "tokenizer.json")).encode(CODE_SNIPPET).ids


def test_chat_template_renders(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Print hello."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nPrint hello.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")


def test_greedy_generation_runs(model, tokenizer) -> None:
    inputs = tokenizer("def main(", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[0] == 1 and inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 8


@pytest.fixture(scope="module")
def heldout_sample(model, tokenizer, train_script) -> tuple[float, torch.Tensor]:
    "The model's mean CE (nats/token) on the script's sample of the held-out split, and the tokens it predicted."
    # 32 windows spread over the whole split (16,352 predicted tokens, ~15 s here): one forward pass for both tests.
    ids = torch.tensor(tokenizer(train_script.read_corpus("heldout"), verbose=False)["input_ids"])
    sample = train_script.sample_windows(ids)
    with torch.no_grad():
        cross_entropy = train_script.model_cross_entropy(model, sample)
    return cross_entropy, train_script.window_targets(sample)


def test_heldout_cross_entropy_beats_unigram(heldout_sample, train_script) -> None:
    model_ce, targets = heldout_sample
    unigram_ce = train_script.unigram_entropy(targets)  # the best unigram model of these very tokens
    assert model_ce <= MAX_RATIO_TO_UNIGRAM * unigram_ce, (
        f"held-out CE {model_ce:.3f} nats/token > {MAX_RATIO_TO_UNIGRAM} x unigram CE {unigram_ce:.3f} "
        f"(ratio {model_ce / unigram_ce:.3f})"
    )


def test_heldout_bits_per_byte_beat_the_previous_model(heldout_sample, tokenizer, train_script) -> None:
    # The sample tracks the whole split (the eval's figure): this model 0.8787 bits per byte against the previous
    # model's 1.0403 (-15.5%; on the whole split 0.8453 against 0.9968, -15.2%). Issue 18's target is -15%.
    model_ce, targets = heldout_sample
    bpb = train_script.bits_per_byte(model_ce, targets, train_script.token_bytes(tokenizer))
    previous = train_script.PREVIOUS_MODEL_BITS_PER_BYTE["sample"]
    assert bpb <= MAX_RATIO_TO_PREVIOUS * previous, f"{bpb:.4f} bits/byte, previous model {previous:.4f}"


@pytest.mark.timeout(300)
def test_answers_heldout_requests_with_code(model_path: Path, train_script) -> None:
    # The eval's 100 requests (files never trained on): 67% of the greedy answers define the name asked for, in
    # float32 on CPU; these are its first 20 (16 of them do; greedy, 512 tokens at most each).
    from tokenizers import Tokenizer

    requests = train_script.heldout_requests(Tokenizer.from_file(str(model_path / "tokenizer.json")), n=ANSWER_REQUESTS)
    assert len(requests) == ANSWER_REQUESTS
    assert all(train_script.split_of(r["path"]) == "heldout" for r in requests)
    answers = train_script.answer_requests(model_path, requests, "cpu")
    share = train_script.answer_share(requests, answers)
    assert share >= MIN_ANSWER_SHARE, f"{share:.0%} of {len(requests)} greedy answers define the name asked for"
