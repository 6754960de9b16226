#!/usr/bin/env python3
"""Build the tiny Qwen3 model embedded in minivllm (``minivllm/data/tiny-qwen3``).

The course needs a *real* Qwen3 checkpoint that is small enough to live inside
the git repository, loads with plain ``transformers`` and produces sensible
text.  This script makes one from scratch, offline, in three steps:

``prepare``  (CPU, needs this machine's Python standard library)
    * Corpus: every ``*.py`` file of the standard library
      (``sysconfig.get_paths()["stdlib"]``), *including* its test suites
      (they add a lot of varied code), *excluding* ``site-packages``,
      ``dist-packages`` and ``__pycache__``.  Files are sorted by relative
      path and read as UTF-8; undecodable files are skipped.
    * Split: a file is held out when the SHA-256 of its relative POSIX path
      falls in the lowest 5% (``split_of``).  The split depends only on the
      path, so it is the same on every machine and Python version: a held-out
      path is never trained on, whatever version rebuilds the held-out text.
    * Tokenizer: byte-level BPE (``tokenizers``), vocabulary 4096, with the
      special tokens ``<|endoftext|>`` (eos and pad), ``<|im_start|>`` and
      ``<|im_end|>`` and a ChatML chat template like Qwen's.
    * Documents are joined with ``<|endoftext|>``, tokenized and written as
      ``uint16`` arrays.
    * Conversations (``conversations``): every documented function, method and
      class of the *training* split asks for itself: the user's request is its
      docstring's first paragraph phrased as a request naming its signature
      (``chat_request``), the assistant's answer its source in a Python code
      block (``chat_answer``), in the chat template; those longer than one
      training window are dropped.  The held-out split's definitions give the
      evaluation requests (``heldout_requests``: 100, in a stable hash order);
      its files are never trained on.
    The build folder is self-contained (~23 MB for the Python 3.11 standard
    library: ~8.9M train / ~0.5M held-out tokens, ~8.4k conversations), so it
    can be copied to a GPU machine that has no standard-library corpus, no
    internet and maybe another Python version.

``train``  (CPU or CUDA, needs only the build folder)
    A ``Qwen3ForCausalLM`` that keeps Qwen3's features: grouped-query
    attention (8 query heads, 4 KV heads), q/k RMSNorm, ``heads * head_dim``
    (512) != ``hidden_size`` (384) and tied embeddings.  AdamW with linear
    warmup and cosine decay on random 512-token windows drawn by a seeded
    generator; bf16 autocast (and optionally ``torch.compile``) on CUDA.  The
    corpus is small for the model (it is seen ~20 times), so dropout
    regularizes (on attention probabilities and on each block's output, while
    training only).  The last ``chat_steps`` steps are the chat stage: half of
    each batch are windows that start at a conversation and train on its
    answer tokens only.  Optionally (``--ema``) the saved weights are a moving
    average of the trained ones (from step ``--ema-start`` on); with
    ``--ema-until`` the average replaces the weights at that step and the
    last steps train on from it.  Writes a
    Hugging Face folder (bf16 weights, tokenizer, chat template, a generation
    config that also stops at ``<|im_end|>``, model card) and its evaluation
    as ``<out>.eval.json``.

``eval``
    Held-out cross-entropy (nats/token) of a saved folder against two unigram
    baselines: token counts of the *training* split with add-one smoothing,
    and the empirical distribution of the evaluated held-out tokens
    themselves (the best any unigram model can do on that text; the stricter
    of the two, used by ``tests/test_tiny_model.py``); the same as bits per
    UTF-8 byte (tokenizer-independent); and the share of the held-out requests
    whose greedy answer (through minivllm) parses as Python and defines the
    function or class asked for (``defines``).

``all`` chains the three for a local run.  Typical use::

    python tools/train_tiny_qwen3.py prepare --build build/tiny
    python tools/train_tiny_qwen3.py train --build build/tiny \\
        --out minivllm/data/tiny-qwen3 --device cuda --compile \\
        --ema 0.9995 --ema-until 6000     # the shipped model (its card)
    python tools/train_tiny_qwen3.py eval --build build/tiny \\
        --model minivllm/data/tiny-qwen3

Seeds are fixed everywhere (``random``, NumPy, torch, the window sampler).
On CPU a run is reproducible; on CUDA some kernels (e.g. embedding and
attention backward) are not bitwise deterministic, so results can differ in
the last digits from run to run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import re
import sys
import sysconfig
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SEED = 1234
VOCAB_SIZE = 4096
HELDOUT_FRACTION = 0.05
SEQ_LEN = 512
EOS_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]  # ids 0, 1, 2
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
SPLITS = ("train", "heldout")

# ChatML, as in Qwen's templates (without Qwen3's tool-calling / thinking parts).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Qwen3 architecture, shrunk: 8 * 64 = 512 != 256 (as in real Qwen3 models).
MODEL_CONFIG: dict = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    max_window_layers=8,  # as in real Qwen3 configs (sliding window is off anyway)
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    initializer_range=0.02,
)

# Files inside a build folder.
TOKENIZER_DIR = "tokenizer"
TRAIN_IDS = "train.npy"
HELDOUT_IDS = "heldout.npy"
CHAT_IDS = "chat.npy"  # the training split's conversations, joined with <|endoftext|>
CHAT_SPANS = "chat_spans.npy"  # [n, 3] int64: start, first answer token, end of each conversation
CHAT_HELDOUT = "chat_heldout.json"  # the evaluation requests, from held-out files only
META = "meta.json"

# Conversations: at most one training window long; the evaluation asks this many held-out requests.
CHAT_MAX_TOKENS = SEQ_LEN
CHAT_EVAL_REQUESTS = 100
CHAT_ANSWER_TOKENS = 512  # max_tokens of an evaluation answer

# The tests' cheap held-out sample: this many windows spread evenly over the whole split (``sample_windows``).
SAMPLE_WINDOWS = 32

# The model this script made before the chat stage (5.0M parameters, 4 layers), measured by `eval` on
# the whole held-out split (514,066 predicted tokens), on the first 16,384 held-out tokens and on the
# sample (tests/test_tiny_model.py): the new model must be at least 15% lower (issue 18).
PREVIOUS_MODEL_BITS_PER_BYTE = {"all": 0.9968, "first_16384_tokens": 0.9997, "sample": 1.0403}


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def stdlib_root() -> Path:
    """The folder of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """``"heldout"`` for ~5% of paths (stable SHA-256 of the path), else ``"train"``."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "heldout" if bucket < HELDOUT_FRACTION else "train"


def _all_python_files(root: Path) -> list[str]:
    """Relative POSIX paths of all ``*.py`` files under ``root``, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        rel_folder = Path(folder).relative_to(root)
        found += [(rel_folder / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted standard-library ``*.py`` files of one split (``train``/``heldout``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    root = stdlib_root() if root is None else root
    return [root / rel for rel in _all_python_files(root) if split_of(rel) == split]


def read_documents(split: str, max_chars: int | None = None, root: Path | None = None) -> list[str]:
    """Texts of the split's files in order (UTF-8; undecodable files skipped).

    With ``max_chars``, stops after the first documents totalling at least
    that many characters (the corpus prefix, handy for quick evaluations).
    """
    documents, total = [], 0
    for path in corpus_files(split, root):
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        documents.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return documents


def read_corpus(split: str, max_chars: int | None = None, root: Path | None = None) -> str:
    """The split's documents joined with the end-of-text token."""
    return EOS_TOKEN.join(read_documents(split, max_chars, root))


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_bpe(documents: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``documents``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerBase:
    """A transformers fast tokenizer (eos/pad, ChatML specials and template)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save with the chat template inline in tokenizer_config.json.

    transformers 5 would otherwise write it to a separate chat_template.jinja,
    which older loaders (and code that only reads tokenizer_config.json) miss.
    """
    tokenizer.save_pretrained(folder, save_jinja_files=False)


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """Load a saved tokenizer folder offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
    """Token ids of ``EOS.join(documents)`` as ``uint16`` (one encode per document)."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for i, encoding in enumerate(tokenizer.encode_batch(documents)):
        if i:
            ids.append(eos_id)
        ids.extend(encoding.ids)
    assert max(ids) < 2**16
    return np.asarray(ids, dtype=np.uint16)


# --------------------------------------------------------------------------
# Conversations: each documented function or class asks for itself
# --------------------------------------------------------------------------


@dataclass
class Definition:
    """A documented function, method or class of the corpus, with what a request needs."""

    path: str  # relative to the standard library
    qualname: str  # Outer.inner
    name: str
    kind: str  # "function", "method" or "class"
    signature: str  # name(args) -> ret, or Name(bases) for a class
    doc: str  # the docstring's first paragraph, on one line
    source: str  # dedented, without decorators


def doc_summary(docstring: str, max_chars: int = 300) -> str:
    """The first paragraph of a cleaned docstring on one line, cut at a word near ``max_chars``."""
    summary = " ".join(docstring.strip().split("\n\n")[0].split())
    if len(summary) > max_chars:
        summary = summary[:max_chars].rsplit(" ", 1)[0] + " ..."
    return summary


def signature_of(node: ast.AST) -> str:
    """``name(args) -> ret`` of a function, ``Name(bases)`` (or ``Name``) of a class."""
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
        return f"{node.name}({bases})" if bases else node.name
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({ast.unparse(node.args)}){returns}"


def source_segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment(text, node, padded=True)`` from the text's lines, split once per file
    (``get_source_segment`` splits the whole text again at every call: minutes over the standard library)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    head, tail = lines[first].encode("utf-8"), lines[last].encode("utf-8")
    if first == last:
        return head[node.col_offset : node.end_col_offset].decode("utf-8")
    padding = re.sub(r"\S", " ", head[: node.col_offset].decode("utf-8"))
    return (
        padding
        + head[node.col_offset :].decode("utf-8")
        + "".join(lines[first + 1 : last])
        + tail[: node.end_col_offset].decode("utf-8")
    )


def documented_definitions(text: str, path: str) -> list[Definition]:
    """Every function, method and class of a module that has a docstring, in source order."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", text)  # line ends as the parser counts them
    found: list[Definition] = []

    def visit(node: ast.AST, outer: list[str], in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            is_class = isinstance(child, ast.ClassDef)
            docstring = ast.get_docstring(child)
            source = docstring and doc_summary(docstring) and source_segment(lines, child)
            if source:
                kind = "class" if is_class else "method" if in_class else "function"
                found.append(
                    Definition(
                        path,
                        ".".join(outer + [child.name]),
                        child.name,
                        kind,
                        signature_of(child),
                        doc_summary(docstring),
                        textwrap.dedent(source).rstrip(),
                    )
                )
            visit(child, outer + [child.name], is_class)

    visit(tree, [], False)
    return found


REQUEST_TEMPLATES = {
    "function": (
        "Write a Python function `{signature}`: {doc}",
        "Implement `{signature}` in Python. {doc}",
        "Write `{signature}`. It should do this: {doc}",
    ),
    "method": (
        "Write the method `{signature}` of the class `{owner}`: {doc}",
        "Implement `{owner}.{signature}` in Python. {doc}",
    ),
    "class": ("Write a Python class `{signature}`: {doc}", "Implement the class `{signature}` in Python. {doc}"),
}


def stable_hash(text: str) -> int:
    """A platform-independent hash (SHA-256 prefix) for seeded choices and orders."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def chat_request(d: Definition) -> str:
    """The user's request for ``d``: its docstring's summary phrased as a request (template chosen by hash)."""
    templates = REQUEST_TEMPLATES[d.kind]
    template = templates[stable_hash(f"{d.path}:{d.qualname}") % len(templates)]
    owner = d.qualname.rsplit(".", 1)[0] if "." in d.qualname else ""
    return template.format(signature=d.signature, doc=d.doc, owner=owner)


def chat_answer(d: Definition) -> str:
    """The assistant's answer: the definition's source in a Python code block."""
    return f"```python\n{d.source}\n```"


def chat_prompt(request: str) -> str:
    """The chat template's text for one user request, ready for the assistant's answer."""
    return f"{IM_START}user\n{request}{IM_END}\n{IM_START}assistant\n"


def answer_code(answer: str) -> str:
    """The code of an answer: inside its first ```python block (to the end if the block is unclosed), else all."""
    start = answer.find("```python\n")
    if start < 0:
        return answer
    code = answer[start + len("```python\n") :]
    return code.split("```", 1)[0]


def defines(answer: str, name: str) -> bool:
    """Does the answer's code parse as Python and define ``name`` at its top level?"""
    try:
        tree = ast.parse(answer_code(answer))
    except (SyntaxError, ValueError):
        return False
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(node, kinds) and node.name == name for node in tree.body)


def split_definitions(split: str, root: Path | None = None) -> list[Definition]:
    """The documented definitions of a split's files (files in order, definitions in source order)."""
    found: list[Definition] = []
    root = stdlib_root() if root is None else root
    for path in corpus_files(split, root):
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += documented_definitions(text, path.relative_to(root).as_posix())
    return found


def encode_conversation(tokenizer: Tokenizer, d: Definition) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids ending with <|im_end|> and a newline), encoded apart as at inference."""
    prompt = tokenizer.encode(chat_prompt(chat_request(d))).ids
    return prompt, tokenizer.encode(chat_answer(d) + f"{IM_END}\n").ids


def conversations(tokenizer: Tokenizer, definitions: list[Definition]) -> tuple[np.ndarray, np.ndarray]:
    """The definitions whose conversation fits ``CHAT_MAX_TOKENS``, as joined ids and [start, answer, end] spans."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    spans: list[tuple[int, int, int]] = []
    for d in definitions:
        prompt, answer = encode_conversation(tokenizer, d)
        if len(prompt) + len(answer) > CHAT_MAX_TOKENS:
            continue
        start = len(ids)
        ids += prompt + answer + [eos_id]
        spans.append((start, start + len(prompt), start + len(prompt) + len(answer)))
    return np.asarray(ids, dtype=np.uint16), np.asarray(spans, dtype=np.int64).reshape(-1, 3)


def heldout_requests(tokenizer: Tokenizer, root: Path | None = None, n: int = CHAT_EVAL_REQUESTS) -> list[dict]:
    """``n`` requests from held-out files (fitting ``CHAT_MAX_TOKENS``), in a stable hash order."""
    fitting = [
        d
        for d in split_definitions("heldout", root)
        if sum(map(len, encode_conversation(tokenizer, d))) <= CHAT_MAX_TOKENS
    ]
    fitting.sort(key=lambda d: stable_hash(f"{d.path}:{d.qualname}"))
    return [
        {"path": d.path, "qualname": d.qualname, "name": d.name, "kind": d.kind, "request": chat_request(d)}
        for d in fitting[:n]
    ]


# --------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------


def prepare(build: Path) -> dict:
    """Corpus split + tokenizer + tokenized ids into the self-contained ``build`` folder."""
    build.mkdir(parents=True, exist_ok=True)
    start = time.time()
    train_docs, heldout_docs = read_documents("train"), read_documents("heldout")
    print(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out files from {stdlib_root()}")

    bpe = train_bpe(train_docs)
    save_tokenizer(wrap_tokenizer(bpe), build / TOKENIZER_DIR)
    print(f"tokenizer: vocab {bpe.get_vocab_size()} trained in {time.time() - start:.0f}s")

    meta = {
        "python": platform.python_version(),
        "stdlib": str(stdlib_root()),
        "seed": SEED,
        "heldout_fraction": HELDOUT_FRACTION,
    }
    for split, docs, name in (("train", train_docs, TRAIN_IDS), ("heldout", heldout_docs, HELDOUT_IDS)):
        ids = encode_documents(bpe, docs)
        np.save(build / name, ids)
        meta[split] = {"files": len(docs), "chars": sum(map(len, docs)), "tokens": int(len(ids))}
        print(f"{split}: {len(ids):,} tokens ({meta[split]['chars'] / len(ids):.2f} chars/token)")

    definitions = split_definitions("train")
    chat_ids, spans = conversations(bpe, definitions)
    np.save(build / CHAT_IDS, chat_ids)
    np.save(build / CHAT_SPANS, spans)
    requests = heldout_requests(bpe)
    (build / CHAT_HELDOUT).write_text(json.dumps(requests, indent=1) + "\n")
    meta["chat"] = {
        "definitions": len(definitions),
        "conversations": len(spans),
        "tokens": int(len(chat_ids)),
        "answer_tokens": int((spans[:, 2] - spans[:, 1]).sum()),
        "heldout_requests": len(requests),
    }
    print(
        f"chat: {len(spans):,} of {len(definitions):,} documented definitions fit {CHAT_MAX_TOKENS} tokens "
        f"({len(chat_ids):,} tokens); {len(requests)} held-out requests"
    )
    (build / META).write_text(json.dumps(meta, indent=2) + "\n")
    print(f"prepare done in {time.time() - start:.0f}s -> {build} ({folder_size(build) / 1e6:.1f} MB)")
    return meta


# --------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run."""

    steps: int = 6500
    batch_size: int = 64
    seq_len: int = SEQ_LEN
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = SEED
    log_every: int = 100
    eval_every: int = 1000
    chat_steps: int = 2500  # the last steps fill chat_fraction of each batch with conversations
    chat_fraction: float = 0.5
    dropout: float = 0.3  # on attention probabilities and on each block's output, while training only
    chat_dropout: float | None = None  # the chat stage's dropout (None: the same as before it)
    compile: bool = False  # torch.compile the training forward (CUDA)
    ema: float = 0.0  # > 0: save an exponential moving average of the weights with this decay (0: the last weights)
    ema_start: int = 0  # the step whose weights the average starts from (e.g. the chat stage's first)
    ema_until: int = 0  # > 0: the step at which the average replaces the weights, trained on from there


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    return torch.device(name)


def build_model(eos_id: int, seed: int = SEED, overrides: dict | None = None) -> PreTrainedModel:
    """A freshly initialised tiny ``Qwen3ForCausalLM`` (float32); ``overrides`` change MODEL_CONFIG's fields."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {**MODEL_CONFIG, **(overrides or {})}
    fields["max_window_layers"] = fields["num_hidden_layers"]
    config = Qwen3Config(**fields, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def sample_batch(
    tokens: torch.Tensor, cfg: TrainConfig, generator: torch.Generator, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len + 1`` tokens -> (inputs, next-token targets)."""
    rows = cfg.batch_size if rows is None else rows
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (rows, 1), generator=generator)
    window = tokens[(starts + torch.arange(cfg.seq_len + 1)).to(tokens.device)]
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


IGNORE = -100  # F.cross_entropy's ignore_index: no loss on the request (or past the answer)


def sample_chat_batch(
    chat: torch.Tensor, spans: torch.Tensor, rows: int, cfg: TrainConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows starting at random conversations; only their answer tokens are targets."""
    pick = spans[torch.randint(0, len(spans), (rows,), generator=generator)]
    position = pick[:, :1] + torch.arange(cfg.seq_len + 1)
    window = chat[position.clamp(max=len(chat) - 1).to(chat.device)]
    target_position = position[:, 1:]
    answer = (target_position >= pick[:, 1:2]) & (target_position < pick[:, 2:3])
    targets = window[:, 1:].masked_fill(~answer.to(chat.device), IGNORE)
    return window[:, :-1].contiguous(), targets


def mixed_batch(step: int, data: dict, cfg: TrainConfig, generator: torch.Generator):
    """Plain corpus windows; in the last ``chat_steps`` steps, ``chat_fraction`` of the rows are conversations."""
    if step < cfg.steps - cfg.chat_steps or "chat" not in data:
        return sample_batch(data["train"], cfg, generator)
    n_chat = round(cfg.batch_size * cfg.chat_fraction)
    plain = sample_batch(data["train"], cfg, generator, cfg.batch_size - n_chat)
    chat = sample_chat_batch(data["chat"], data["spans"], n_chat, cfg, generator)
    return torch.cat([plain[0], chat[0]]), torch.cat([plain[1], chat[1]])


def add_dropout(model: torch.nn.Module, p: float):
    """Dropout while training: on attention probabilities (the config's own field) and on the output of
    every attention and MLP block (hooks). Returns ``set_rate(q)``, which changes it (0: off, as for saving)."""
    rate = {"p": p}

    def set_rate(q: float) -> None:
        rate["p"] = model.config.attention_dropout = q
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = q

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(lambda m, args, out: (F.dropout(out[0], rate["p"], m.training), *out[1:]))
        layer.mlp.register_forward_hook(lambda m, args, out: F.dropout(out, rate["p"], m.training))
    set_rate(p)
    return set_rate


def autocast(device: torch.device):
    """bf16 autocast on CUDA, a no-op context on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def next_token_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy (nats) of ``targets`` given ``inputs``; logits in float32."""
    logits = model(input_ids=inputs, use_cache=False).logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction, ignore_index=IGNORE
    )


def train_model(model: torch.nn.Module, data: dict, cfg: TrainConfig, device: torch.device) -> float:
    """The training loop over ``data`` (train, heldout, chat, spans); progress every ``cfg.log_every`` steps.
    Returns its time in seconds (compiling included)."""
    seed_everything(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = make_optimizer(model, cfg, device)
    set_dropout = add_dropout(model, cfg.dropout)
    model.train()
    forward = torch.compile(model) if cfg.compile else model
    heldout = data["heldout"]
    tokens_per_step = cfg.batch_size * cfg.seq_len
    ema = None
    running, t_log, t_start = 0.0, time.time(), time.time()
    for step in range(cfg.steps):
        if cfg.ema and step == cfg.ema_start:  # the average starts from the weights before this step
            ema = [p.detach().clone() for p in model.parameters()]
        if ema is not None and cfg.ema_until and step == cfg.ema_until:  # the average becomes the weights
            use_average(model, ema, heldout[: 64 * cfg.seq_len], device, cfg.seq_len)
            model.train()
            ema = None
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        if step == cfg.steps - cfg.chat_steps and cfg.chat_dropout is not None:
            set_dropout(cfg.chat_dropout)
        inputs, targets = mixed_batch(step, data, cfg, generator)
        with autocast(device):
            loss = next_token_loss(forward, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            with torch.no_grad():
                for average, p in zip(ema, model.parameters()):
                    average.lerp_(p, 1 - cfg.ema)
        running += loss.detach()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            n = (step % cfg.log_every) + 1
            elapsed = time.time() - t_log
            print(
                f"step {step + 1:5d}/{cfg.steps}  loss {float(running) / n:.4f}  lr {lr_at(step, cfg):.2e}  "
                f"{n * tokens_per_step / elapsed:,.0f} tok/s  {time.time() - t_start:.0f}s",
                flush=True,
            )
            running, t_log = 0.0, time.time()
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            with autocast(device):
                ce = model_cross_entropy(model, heldout[: 64 * cfg.seq_len], cfg.seq_len)
            print(f"step {step + 1:5d}  held-out CE {ce:.4f} (first {64 * cfg.seq_len} tokens)", flush=True)
            model.train()
    seconds = time.time() - t_start
    print(f"trained {cfg.steps} steps in {seconds:.0f}s")
    set_dropout(0.0)
    if ema is not None:
        use_average(model, ema, heldout[: 64 * cfg.seq_len], device, cfg.seq_len)
    return seconds


def use_average(
    model: torch.nn.Module, ema: list[torch.Tensor], heldout: torch.Tensor, device: torch.device, window: int = SEQ_LEN
) -> None:
    """Replace the model's weights by their moving average, printing the held-out CE of both."""
    with autocast(device):
        last = model_cross_entropy(model, heldout, window)
        with torch.no_grad():
            for p, average in zip(model.parameters(), ema):
                p.copy_(average)
        averaged = model_cross_entropy(model, heldout, window)
    print(f"held-out CE (first {len(heldout)} tokens): last weights {last:.4f}, moving average {averaged:.4f} (saved)")


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------


def windows(ids: torch.Tensor, window: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping ``[n, window]`` windows of ``ids`` (the tail is dropped)."""
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"need at least {window} tokens, got {len(ids)}")
    return ids[: n * window].reshape(n, window).long()


@torch.no_grad()
def model_cross_entropy(model: torch.nn.Module, ids: torch.Tensor, window: int = SEQ_LEN, batch: int = 8) -> float:
    """Mean CE (nats/token) predicting tokens 1..window-1 of each window from their prefix."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in windows(ids, window).split(batch):
        chunk = chunk.to(device)
        total += float(next_token_loss(model, chunk[:, :-1], chunk[:, 1:], reduction="sum"))
        count += chunk[:, 1:].numel()
    return total / count


def sample_windows(ids: torch.Tensor, n: int = SAMPLE_WINDOWS, window: int = SEQ_LEN) -> torch.Tensor:
    """``n`` of the split's windows, spread evenly from its first to its last (flattened back to ids)."""
    all_windows = windows(ids, window)
    return all_windows[torch.linspace(0, len(all_windows) - 1, n).round().long()].reshape(-1)


def window_targets(ids: torch.Tensor, window: int = SEQ_LEN) -> torch.Tensor:
    """The tokens ``model_cross_entropy`` predicts (unigram CE uses the same ones)."""
    return windows(ids, window)[:, 1:].reshape(-1)


def unigram_cross_entropy(targets: torch.Tensor, counts: torch.Tensor) -> float:
    """CE of ``targets`` under unigram probabilities from ``counts`` with add-one smoothing."""
    probs = (counts.double() + 1) / (counts.double().sum() + len(counts))
    return float(-probs[targets.long()].log().mean())


def unigram_entropy(targets: torch.Tensor) -> float:
    """CE of ``targets`` under their own empirical unigram distribution (best unigram)."""
    counts = torch.bincount(targets.long()).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log()).sum())


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """UTF-8 bytes each id stands for: a byte-level BPE token has one character per byte; specials have none."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([0 if i in special else len(t) for i, t in enumerate(vocab)])


def bits_per_byte(cross_entropy: float, targets: torch.Tensor, nbytes: torch.Tensor) -> float:
    """Mean CE in nats per token -> bits per UTF-8 byte of the same targets (tokenizer-independent)."""
    return cross_entropy * targets.numel() / math.log(2) / float(nbytes[targets.long()].sum())


def model_bits_per_byte(model: torch.nn.Module, ids: torch.Tensor, nbytes: torch.Tensor) -> float:
    """Bits per byte of the model predicting the windows of ``ids`` (``nbytes``: ``token_bytes``)."""
    return bits_per_byte(model_cross_entropy(model, ids), window_targets(ids), nbytes)


ANSWER_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}  # how minivllm answers the held-out requests


def answer_requests(
    model_dir: Path,
    requests: list[dict],
    device: str = "cpu",
    max_tokens: int = CHAT_ANSWER_TOKENS,
) -> list[str]:
    """Greedy answers of the saved model (through minivllm) to each request, as one-turn chats."""
    from minivllm import LLM, SamplingParams

    # On a GPU: a fixed small cache, so that several runs can share the card.
    sizing = {"dtype": ANSWER_DTYPE[device]} | ({} if device == "cpu" else {"num_kvcache_blocks": 4096})
    with LLM(str(model_dir), device=device, **sizing) as llm:
        outputs = llm.chat(
            [[{"role": "user", "content": r["request"]}] for r in requests],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            use_tqdm=False,
        )
    return [o.outputs[0].text for o in outputs]


def answer_share(requests: list[dict], answers: list[str]) -> float:
    """The share of answers that parse as Python and define the name asked for."""
    return sum(defines(a, r["name"]) for r, a in zip(requests, answers)) / len(requests)


def load_ids(path: Path) -> torch.Tensor:
    """A saved ``uint16`` id array as an int64 tensor."""
    return torch.from_numpy(np.load(path).astype(np.int64))


def evaluate(model_dir: Path, build: Path, max_tokens: int | None = None, answer_device: str = "cpu") -> dict:
    """Held-out CE and bits per byte of the saved model (float32) vs the unigram baselines, and the share of
    held-out requests its greedy answer fulfils (through minivllm on ``answer_device``; "none" skips it)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if answer_device == "cuda" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).to(device)
    all_heldout = load_ids(build / HELDOUT_IDS)
    heldout = all_heldout[:max_tokens] if max_tokens else all_heldout
    nbytes = token_bytes(load_tokenizer(model_dir))
    counts = torch.bincount(load_ids(build / TRAIN_IDS), minlength=model.config.vocab_size)
    targets = window_targets(heldout)
    start = time.time()
    result = {
        "eval_tokens": int(targets.numel()),
        "model_ce": model_cross_entropy(model, heldout),
        "unigram_train_add_one_ce": unigram_cross_entropy(targets, counts),
        "unigram_heldout_ce": unigram_entropy(targets),
    }
    result["ratio_to_unigram_heldout"] = result["model_ce"] / result["unigram_heldout_ce"]
    result["bits_per_byte"] = bits_per_byte(result["model_ce"], targets, nbytes)
    print(
        f"held-out CE over {result['eval_tokens']:,} tokens ({time.time() - start:.0f}s): "
        f"model {result['model_ce']:.4f} | unigram(train counts, add-one) {result['unigram_train_add_one_ce']:.4f} | "
        f"unigram(held-out itself) {result['unigram_heldout_ce']:.4f} | "
        f"ratio {result['ratio_to_unigram_heldout']:.3f} (test needs <= 0.6)"
    )
    result["sample_bits_per_byte"] = model_bits_per_byte(model, sample_windows(all_heldout), nbytes)
    print(
        f"held-out bits per byte {result['bits_per_byte']:.4f}; on the tests' sample of {SAMPLE_WINDOWS} windows "
        f"{result['sample_bits_per_byte']:.4f}"
    )
    if answer_device != "none":
        requests = json.loads((build / CHAT_HELDOUT).read_text())
        start = time.time()
        answers = answer_requests(model_dir, requests, answer_device)
        result["answer_share"] = answer_share(requests, answers)
        result["answer_device"], result["answer_dtype"] = answer_device, ANSWER_DTYPE[answer_device]
        result["answers"] = [
            {"request": r["request"], "answer": a, "defines": defines(a, r["name"])} for r, a in zip(requests, answers)
        ]
        print(
            f"held-out requests: {result['answer_share']:.0%} of {len(requests)} greedy answers parse and define "
            f"the name asked for ({time.time() - start:.0f}s on {answer_device})"
        )
    return result


# --------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------


def folder_size(folder: Path) -> int:
    """Total size in bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# What a previous save may have left in the output folder (nothing else is removed).
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "README.md",
)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Write the Hugging Face folder: bf16 weights, config, generation config, tokenizer.

    The model is cast to bfloat16 in place.  transformers saves the tied
    embedding once (no ``lm_head.weight`` in the safetensors file).
    """
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    eos_id = model.config.eos_token_id
    # Like Qwen's checkpoints: generation also ends at the end of a chat turn.
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[eos_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=eos_id,
        do_sample=False,
    )
    model.to(torch.bfloat16).save_pretrained(out)
    save_tokenizer(tokenizer, out)


def training_environment(device: torch.device) -> str:
    """Where a run trains, for the model card: device (and GPU name), torch and transformers versions."""
    import transformers

    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return f"{device.type}{name}, torch {torch.__version__}, transformers {transformers.__version__}"


def write_model_card(
    out: Path,
    meta: dict,
    cfg: TrainConfig,
    device: torch.device,
    result: dict,
    n_params: int,
    config: dict,
    environment: str,
    seconds: float,
) -> None:
    """A short README.md saying how the folder was made (``environment``: ``training_environment``; ``seconds``:
    the training loop's time) and how well it does."""
    c = config
    previous = PREVIOUS_MODEL_BITS_PER_BYTE["all"]
    answers = ""
    if "answer_share" in result:
        answers = (
            f"\n- Held-out requests ({len(result['answers'])}, from files never trained on): "
            f"{result['answer_share']:.0%} of the greedy answers (minivllm, {result['answer_dtype']} on "
            f"{result['answer_device']}) parse as Python and define the function or class asked for."
        )
    chat_dropout = "" if cfg.chat_dropout is None else f" ({cfg.chat_dropout:g} in the chat stage)"
    since = f" from step {cfg.ema_start}" if cfg.ema_start else ""
    average = f"a moving average of the weights (decay {cfg.ema:g}{since})"
    average = (
        f"{average} replacing them at step {cfg.ema_until}, trained on from there, "
        if cfg.ema_until
        else f"saved as {average}, "
    )
    how = (average if cfg.ema else "") + ("torch.compile, " if cfg.compile else "")
    flags = (
        ("" if cfg.chat_dropout is None else f" --chat-dropout {cfg.chat_dropout:g}")
        + (f" --ema {cfg.ema:g}" if cfg.ema else "")
        + (f" --ema-start {cfg.ema_start}" if cfg.ema_start else "")
        + (f" --ema-until {cfg.ema_until}" if cfg.ema_until else "")
        + ("" if cfg.min_lr_ratio == TrainConfig.min_lr_ratio else f" --min-lr-ratio {cfg.min_lr_ratio:g}")
        + (" --compile" if cfg.compile else "")
    )
    card = f"""# tiny-qwen3

A {n_params / 1e6:.1f}M-parameter `Qwen3ForCausalLM` trained from scratch for the minivllm
course on the source code of the Python {meta["python"]} standard library, then taught to
answer a request for a function or class with its code.
Made by `tools/train_tiny_qwen3.py` (see its docstring); do not edit by hand.

- Architecture: {c["num_hidden_layers"]} layers, hidden {c["hidden_size"]}, MLP {c["intermediate_size"]},
  {c["num_attention_heads"]} query / {c["num_key_value_heads"]} KV heads of dim {c["head_dim"]},
  q/k RMSNorm, tied embeddings, RoPE theta {c["rope_parameters"]["rope_theta"]:g}.
- Tokenizer: byte-level BPE, vocab {c["vocab_size"]}; `<|endoftext|>` is eos and pad;
  ChatML `<|im_start|>` / `<|im_end|>` and chat template; generation stops at either.
- Corpus: {meta["train"]["files"]} train files ({meta["train"]["tokens"]:,} tokens);
  {meta["heldout"]["files"]} files held out by path hash ({meta["heldout"]["tokens"]:,} tokens);
  {meta["chat"]["conversations"]:,} conversations from the train files' documented definitions.
- Training: seed {cfg.seed}, {cfg.steps} steps x batch {cfg.batch_size} x {cfg.seq_len} tokens
  (the last {cfg.chat_steps} with {cfg.chat_fraction:.0%} conversations), dropout {cfg.dropout:g}{chat_dropout},
  AdamW lr {cfg.lr:g} (warmup {cfg.warmup_steps}, cosine to {cfg.min_lr_ratio:g}x), {how}on
  {environment}: {seconds:.0f} s.
- Held-out cross-entropy, nats/token over {result["eval_tokens"]:,} tokens (bf16 weights run in float32):
  model **{result["model_ce"]:.3f}**; unigram from train counts with add-one smoothing
  {result["unigram_train_add_one_ce"]:.3f}; unigram fit on the evaluated tokens themselves
  {result["unigram_heldout_ce"]:.3f} (model / unigram = {result["ratio_to_unigram_heldout"]:.3f}).
- Held-out bits per byte: **{result["bits_per_byte"]:.4f}** (the previous 5.0M model: {previous:.4f};
  {1 - result["bits_per_byte"] / previous:.1%} lower).{answers}

Rebuild:

```
python tools/train_tiny_qwen3.py prepare --build build/tiny
python tools/train_tiny_qwen3.py train --build build/tiny --out minivllm/data/tiny-qwen3 \\
    --device {device.type} --steps {cfg.steps} --batch-size {cfg.batch_size} --lr {cfg.lr:g} \\
    --chat-steps {cfg.chat_steps} --chat-fraction {cfg.chat_fraction:g} --dropout {cfg.dropout:g}{flags}
```
"""
    (out / "README.md").write_text(card)


def train(
    build: Path,
    out: Path,
    device_name: str,
    cfg: TrainConfig,
    eval_tokens: int | None,
    overrides: dict | None = None,
    answers_on: str | None = None,
) -> dict:
    """Train from the build folder, save to ``out``, evaluate the saved folder."""
    device = resolve_device(device_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    meta = json.loads((build / META).read_text())
    tokenizer = load_tokenizer(build / TOKENIZER_DIR)
    data = {
        name: load_ids(build / file).to(device)
        for name, file in (("train", TRAIN_IDS), ("heldout", HELDOUT_IDS), ("chat", CHAT_IDS))
    }
    data["spans"] = torch.from_numpy(np.load(build / CHAT_SPANS))
    model = build_model(tokenizer.eos_token_id, cfg.seed, overrides).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M parameters on {device}; train tokens {len(data['train']):,}; "
        f"{len(data['spans']):,} conversations; {asdict(cfg)}"
    )
    seconds = train_model(model, data, cfg, device)
    environment = training_environment(device)
    save_model(model.cpu(), tokenizer, out)
    result = evaluate(out, build, eval_tokens, answers_on or device.type)
    (out.parent / f"{out.name}.eval.json").write_text(json.dumps(result, indent=1) + "\n")
    write_model_card(out, meta, cfg, device, result, n_params, model.config.to_dict(), environment, seconds)
    print(f"saved {out} ({folder_size(out) / 1e6:.2f} MB)")
    return result


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Subcommands prepare / train / eval / all."""
    parser = argparse.ArgumentParser(
        description="Build minivllm's embedded tiny Qwen3 model (see the module docstring)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = TrainConfig()

    def add_build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--build", type=Path, default=Path("build/tiny"), help="build folder")

    def add_train(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", type=Path, required=True, help="output Hugging Face folder")
        p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
        p.add_argument("--steps", type=int, default=defaults.steps)
        p.add_argument("--batch-size", type=int, default=defaults.batch_size)
        p.add_argument("--lr", type=float, default=defaults.lr)
        p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
        p.add_argument("--seed", type=int, default=defaults.seed)
        p.add_argument("--log-every", type=int, default=defaults.log_every)
        p.add_argument("--eval-every", type=int, default=defaults.eval_every, help="0 disables")
        p.add_argument("--chat-steps", type=int, default=defaults.chat_steps, help="last steps that mix in chats")
        p.add_argument("--chat-fraction", type=float, default=defaults.chat_fraction)
        p.add_argument("--dropout", type=float, default=defaults.dropout)
        p.add_argument("--chat-dropout", type=float, default=None, help="dropout in the chat stage (default: same)")
        p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
        p.add_argument(
            "--ema",
            type=float,
            default=defaults.ema,
            help="save a moving average of the weights with this decay, e.g. 0.999 (0: the last weights)",
        )
        p.add_argument(
            "--ema-start",
            type=int,
            default=defaults.ema_start,
            help="the step the moving average starts from (e.g. the chat stage's first: steps - chat steps)",
        )
        p.add_argument(
            "--ema-until",
            type=int,
            default=defaults.ema_until,
            help="at this step the average replaces the weights, which train on from it (0: at the end)",
        )
        p.add_argument(
            "--min-lr-ratio", type=float, default=defaults.min_lr_ratio, help="the cosine schedule ends at lr x this"
        )
        p.add_argument(
            "--model-config",
            type=json.loads,
            default=None,
            help="JSON object overriding MODEL_CONFIG's fields (for experiments)",
        )

    def add_eval(p: argparse.ArgumentParser) -> None:
        p.add_argument("--eval-tokens", type=int, default=None, help="first N held-out tokens (default: all)")
        p.add_argument(
            "--answer-device",
            choices=("cpu", "cuda", "none"),
            default=None,
            help="where minivllm answers the held-out requests (default: the training device; eval: cpu)",
        )

    add_build(sub.add_parser("prepare", help="corpus, tokenizer and token ids (CPU)"))
    for name, help_text in (("train", "train from a build folder, save and evaluate"), ("all", "prepare + train")):
        p = sub.add_parser(name, help=help_text)
        add_build(p)
        add_train(p)
        add_eval(p)
    p_eval = sub.add_parser("eval", help="held-out CE of a saved model vs unigram")
    add_build(p_eval)
    add_eval(p_eval)
    p_eval.add_argument("--model", type=Path, required=True, help="saved Hugging Face folder")
    p_eval.add_argument("--json", type=Path, default=None, help="also write the results (and answers) here")
    return parser.parse_args(argv)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The run's hyper-parameters from the command line (warmup <= 10% of steps)."""
    if args.ema and not 0 <= args.ema_start < args.steps:
        raise SystemExit(f"--ema-start must be a step of the run, in [0, {args.steps}), got {args.ema_start}")
    if args.ema_until and not (args.ema and args.ema_start < args.ema_until < args.steps):
        raise SystemExit(
            f"--ema-until needs --ema and a step after --ema-start and before --steps "
            f"({args.ema_start} < step < {args.steps}), got {args.ema_until}"
        )
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=min(args.warmup_steps, max(1, args.steps // 10)),
        seed=args.seed,
        log_every=args.log_every,
        eval_every=args.eval_every,
        chat_steps=min(args.chat_steps, args.steps),
        chat_fraction=args.chat_fraction,
        dropout=args.dropout,
        chat_dropout=args.chat_dropout,
        compile=args.compile,
        ema=args.ema,
        ema_start=args.ema_start,
        ema_until=args.ema_until,
        min_lr_ratio=args.min_lr_ratio,
    )


def main(argv: list[str] | None = None) -> None:
    """Run the chosen subcommand."""
    args = parse_args(argv)
    if args.command in ("prepare", "all"):
        prepare(args.build)
    if args.command in ("train", "all"):
        train(
            args.build,
            args.out,
            args.device,
            train_config(args),
            args.eval_tokens,
            args.model_config,
            args.answer_device,
        )
    if args.command == "eval":
        result = evaluate(args.model, args.build, args.eval_tokens, args.answer_device or "cpu")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
