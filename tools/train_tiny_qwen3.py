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
      ``uint16`` arrays.  The build folder is self-contained (~19 MB for the
      Python 3.11 standard library: ~8.9M train / ~0.5M held-out tokens), so it
      can be copied to a GPU machine that has no standard-library corpus,
      no internet and maybe another Python version.

``train``  (CPU or CUDA, needs only the build folder)
    A ``Qwen3ForCausalLM`` that keeps Qwen3's features: grouped-query
    attention (8 query heads, 4 KV heads), q/k RMSNorm, ``heads * head_dim``
    (512) != ``hidden_size`` (256) and tied embeddings.  AdamW with linear
    warmup and cosine decay on random 512-token windows drawn by a seeded
    generator; bf16 autocast on CUDA.  Writes a Hugging Face folder
    (bf16 weights, tokenizer, chat template, generation config, model card).

``eval``
    Held-out cross-entropy (nats/token) of a saved folder against two unigram
    baselines: token counts of the *training* split with add-one smoothing,
    and the empirical distribution of the evaluated held-out tokens
    themselves (the best any unigram model can do on that text; the stricter
    of the two, used by ``tests/test_tiny_model.py``).

``all`` chains the three for a local run.  Typical use::

    python tools/train_tiny_qwen3.py prepare --build build/tiny
    python tools/train_tiny_qwen3.py train --build build/tiny \\
        --out minivllm/data/tiny-qwen3 --device cuda
    python tools/train_tiny_qwen3.py eval --build build/tiny \\
        --model minivllm/data/tiny-qwen3

Seeds are fixed everywhere (``random``, NumPy, torch, the window sampler).
On CPU a run is reproducible; on CUDA some kernels (e.g. embedding and
attention backward) are not bitwise deterministic, so results can differ in
the last digits from run to run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
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
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    max_window_layers=4,  # as in real Qwen3 configs (sliding window is off anyway)
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
META = "meta.json"


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
    (build / META).write_text(json.dumps(meta, indent=2) + "\n")
    print(f"prepare done in {time.time() - start:.0f}s -> {build} ({folder_size(build) / 1e6:.1f} MB)")
    return meta


# --------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run."""

    steps: int = 4000
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


def build_model(eos_id: int, seed: int = SEED) -> PreTrainedModel:
    """A freshly initialised tiny ``Qwen3ForCausalLM`` (float32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**MODEL_CONFIG, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
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
    tokens: torch.Tensor, cfg: TrainConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len + 1`` tokens -> (inputs, next-token targets)."""
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch_size, 1), generator=generator)
    window = tokens[(starts + torch.arange(cfg.seq_len + 1)).to(tokens.device)]
    return window[:, :-1], window[:, 1:]


def autocast(device: torch.device):
    """bf16 autocast on CUDA, a no-op context on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def next_token_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy (nats) of ``targets`` given ``inputs``; logits in float32."""
    logits = model(input_ids=inputs, use_cache=False).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)


def train_model(
    model: torch.nn.Module, tokens: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, device: torch.device
) -> None:
    """The training loop (progress printed every ``cfg.log_every`` steps)."""
    seed_everything(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = make_optimizer(model, cfg, device)
    model.train()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    running, t_log, t_start = 0.0, time.time(), time.time()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        inputs, targets = sample_batch(tokens, cfg, generator)
        with autocast(device):
            loss = next_token_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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
    print(f"trained {cfg.steps} steps in {time.time() - t_start:.0f}s")


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


def load_ids(path: Path) -> torch.Tensor:
    """A saved ``uint16`` id array as an int64 tensor."""
    return torch.from_numpy(np.load(path).astype(np.int64))


def evaluate(model_dir: Path, build: Path, max_tokens: int | None = None) -> dict:
    """Held-out CE of the saved model (float32 on CPU) vs the unigram baselines."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    heldout = load_ids(build / HELDOUT_IDS)
    if max_tokens:
        heldout = heldout[:max_tokens]
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
    print(
        f"held-out CE over {result['eval_tokens']:,} tokens ({time.time() - start:.0f}s): "
        f"model {result['model_ce']:.4f} | unigram(train counts, add-one) {result['unigram_train_add_one_ce']:.4f} | "
        f"unigram(held-out itself) {result['unigram_heldout_ce']:.4f} | "
        f"ratio {result['ratio_to_unigram_heldout']:.3f} (test needs <= 0.6)"
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
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.to(torch.bfloat16).save_pretrained(out)
    save_tokenizer(tokenizer, out)


def write_model_card(
    out: Path, meta: dict, cfg: TrainConfig, device: torch.device, result: dict, n_params: int
) -> None:
    """A short README.md saying how the folder was made."""
    import transformers

    c = MODEL_CONFIG
    card = f"""# tiny-qwen3

A {n_params / 1e6:.1f}M-parameter `Qwen3ForCausalLM` trained from scratch for the minivllm
course on the source code of the Python {meta['python']} standard library.
Made by `tools/train_tiny_qwen3.py` (see its docstring); do not edit by hand.

- Architecture: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLP {c['intermediate_size']},
  {c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads of dim {c['head_dim']},
  q/k RMSNorm, tied embeddings, RoPE theta {c['rope_parameters']['rope_theta']:g}.
- Tokenizer: byte-level BPE, vocab {c['vocab_size']}; `<|endoftext|>` is eos and pad;
  ChatML `<|im_start|>` / `<|im_end|>` and chat template.
- Corpus: {meta['train']['files']} train files ({meta['train']['tokens']:,} tokens);
  {meta['heldout']['files']} files held out by path hash ({meta['heldout']['tokens']:,} tokens).
- Training: seed {cfg.seed}, {cfg.steps} steps x batch {cfg.batch_size} x {cfg.seq_len} tokens,
  AdamW lr {cfg.lr:g} (warmup {cfg.warmup_steps}, cosine to {cfg.min_lr_ratio:g}x), {device.type},
  torch {torch.__version__}, transformers {transformers.__version__}.
- Held-out cross-entropy, nats/token over {result['eval_tokens']:,} tokens (bf16 weights run in float32):
  model **{result['model_ce']:.3f}**; unigram from train counts with add-one smoothing
  {result['unigram_train_add_one_ce']:.3f}; unigram fit on the evaluated tokens themselves
  {result['unigram_heldout_ce']:.3f} (model / unigram = {result['ratio_to_unigram_heldout']:.3f}).

Rebuild:

```
python tools/train_tiny_qwen3.py prepare --build build/tiny
python tools/train_tiny_qwen3.py train --build build/tiny --out minivllm/data/tiny-qwen3 \\
    --device {device.type} --steps {cfg.steps} --batch-size {cfg.batch_size}
```
"""
    (out / "README.md").write_text(card)


def train(build: Path, out: Path, device_name: str, cfg: TrainConfig, eval_tokens: int | None) -> dict:
    """Train from the build folder, save to ``out``, evaluate the saved folder."""
    device = resolve_device(device_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    meta = json.loads((build / META).read_text())
    tokenizer = load_tokenizer(build / TOKENIZER_DIR)
    tokens = load_ids(build / TRAIN_IDS).to(device)
    heldout = load_ids(build / HELDOUT_IDS).to(device)
    model = build_model(tokenizer.eos_token_id, cfg.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters on {device}; train tokens {len(tokens):,}; {asdict(cfg)}")
    train_model(model, tokens, heldout, cfg, device)
    save_model(model.cpu(), tokenizer, out)
    result = evaluate(out, build, eval_tokens)
    write_model_card(out, meta, cfg, device, result, n_params)
    print(f"saved {out} ({folder_size(out) / 1e6:.2f} MB)")
    return result


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Subcommands prepare / train / eval / all."""
    parser = argparse.ArgumentParser(description="Build minivllm's embedded tiny Qwen3 model (see the module docstring).")
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

    def add_eval(p: argparse.ArgumentParser) -> None:
        p.add_argument("--eval-tokens", type=int, default=None, help="first N held-out tokens (default: all)")

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
    return parser.parse_args(argv)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The run's hyper-parameters from the command line (warmup <= 10% of steps)."""
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=min(args.warmup_steps, max(1, args.steps // 10)),
        seed=args.seed,
        log_every=args.log_every,
        eval_every=args.eval_every,
    )


def main(argv: list[str] | None = None) -> None:
    """Run the chosen subcommand."""
    args = parse_args(argv)
    if args.command in ("prepare", "all"):
        prepare(args.build)
    if args.command in ("train", "all"):
        train(args.build, args.out, args.device, train_config(args), args.eval_tokens)
    if args.command == "eval":
        evaluate(args.model, args.build, args.eval_tokens)


if __name__ == "__main__":
    sys.exit(main())
