#!/usr/bin/env python3
"""Build the draft model for speculative decoding (``minivllm/data/tiny-qwen3-draft``) from the tiny target.

A draft model must speak the target's tokenizer: its guesses are the target's token ids. No small checkpoint
shares the tiny model's tokenizer, so this script cuts one out of the target itself, offline, on the CPU:

* Init: a ``Qwen3ForCausalLM`` like the target (``minivllm/data/tiny-qwen3``) with ``--layers`` (2) decoder
  layers: the target's token embeddings (tied to the LM head, as in the target), its first ``--layers`` decoder
  layers and its final RMSNorm, copied.
* Distillation (``--steps``, 0 to ship the bare cut): random ``--window``-token windows (a seeded generator) of the
  standard library's training split, the target's corpus (``train_tiny_qwen3.read_documents("train")``, its
  first ``--max-chars`` characters), tokenized with the target's tokenizer. The loss is KL(target || draft) of the
  next-token distributions at every position of the window, the target in float32 without gradients. AdamW (lr
  ``--lr``, linear warmup over the first tenth of the steps, cosine to 0.1x), float32, seed ``--seed`` for
  ``random``, NumPy, torch and the window sampler: a run is reproducible on one machine and torch version.
* Evaluation: on ``--eval-windows`` windows of the held-out split (files never trained on by either model), the share
  of positions where the draft's argmax equals the target's (the greedy acceptance rate of a one-token guess),
  before and after distillation.
* Output: bf16 safetensors, config, the target's generation config and tokenizer files (copied byte for byte, so
  the tokenizers are the same), and a README model card with the settings and the evaluation.

Typical use (a few minutes on two CPU cores)::

    python tools/make_tiny_draft.py --out minivllm/data/tiny-qwen3-draft
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_qwen3 import EOS_TOKEN, read_documents  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "minivllm" / "data" / "tiny-qwen3"
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=TARGET)
    p.add_argument("--out", type=Path, default=ROOT / "minivllm" / "data" / "tiny-qwen3-draft")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-chars", type=int, default=2_000_000)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def token_ids(tokenizer, split: str, max_chars: int) -> torch.Tensor:
    "The split's first documents (at least `max_chars` characters), joined with the end-of-text token."
    return torch.tensor(tokenizer.encode(EOS_TOKEN.join(read_documents(split, max_chars))), dtype=torch.long)


def cut(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    "A Qwen3 of the target's first `layers` layers, its embeddings (tied) and its final norm."
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = target.config.to_dict()
    fields.update(num_hidden_layers=layers, max_window_layers=layers, layer_types=fields["layer_types"][:layers])
    config = Qwen3Config(**fields)
    draft = Qwen3ForCausalLM(config).float()
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing or missing == ["lm_head.weight"], missing  # (tied: the embedding)
    assert all(k.startswith("model.layers.") for k in unexpected), unexpected  # the layers cut off
    draft.tie_weights()
    return draft


def windows(ids: torch.Tensor, n: int, window: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - window, (n,), generator=generator)
    return torch.stack([ids[s : s + window] for s in starts.tolist()])


@torch.no_grad()
def agreement(draft: torch.nn.Module, target: torch.nn.Module, batch: torch.Tensor) -> float:
    "The share of positions where the draft's argmax is the target's."
    draft.eval()
    same = [(draft(b[None]).logits.argmax(-1) == target(b[None]).logits.argmax(-1)).float().mean() for b in batch]
    return float(torch.stack(same).mean())


def lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def distill(draft, target, ids: torch.Tensor, args: argparse.Namespace) -> float:
    "KL(target || draft) on random windows; returns the last step's loss."
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    draft.train()
    start, loss = time.time(), torch.tensor(0.0)
    for step in range(args.steps):
        batch = windows(ids, args.batch_size, args.window, generator)
        with torch.no_grad():
            p_log = F.log_softmax(target(batch).logits.float(), -1)
        q_log = F.log_softmax(draft(batch).logits.float(), -1)
        loss = F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  KL {loss.item():.4f}  {time.time() - start:6.0f} s", flush=True)
    return loss.item()


def write_card(out: Path, args: argparse.Namespace, result: dict) -> None:
    text = f"""# tiny-qwen3-draft

A {result["params"] / 1e6:.1f}M-parameter `Qwen3ForCausalLM` for speculative decoding with `tiny-qwen3`
(`speculative_config={{"method": "draft_model", "model": TINY_DRAFT_PATH, ...}}`, deep dive 10).
Made by `tools/make_tiny_draft.py` (see its docstring); do not edit by hand.

- Architecture: the target's, with {args.layers} decoder layers instead of {result["target_layers"]}.
- Init: the target's embeddings (tied to the LM head), its first {args.layers} decoder layers and its final norm.
- Distillation: {args.steps} steps x batch {args.batch_size} x {args.window} tokens of the standard library's
  training split (first {args.max_chars:,} characters: {result["train_tokens"]:,} tokens), loss KL(target || draft),
  AdamW lr {args.lr} (warmup, cosine to 0.1x), seed {args.seed}, float32 on the CPU: {result["seconds"]:.0f} s.
- Tokenizer: the target's files, copied (the same ids).
- Held-out agreement (the draft's argmax equals the target's, {args.eval_windows} windows of {args.window} tokens):
  {result["agreement_before"]:.1%} for the bare cut, **{result["agreement_after"]:.1%}** after distillation.

Rebuild:

```
python tools/make_tiny_draft.py --out minivllm/data/tiny-qwen3-draft --layers {args.layers} --steps {args.steps}
```
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args(argv)
    seed_everything(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    train_ids = token_ids(tokenizer, "train", args.max_chars)
    held = windows(
        token_ids(tokenizer, "heldout", 400_000), args.eval_windows, args.window, torch.Generator().manual_seed(0)
    )
    draft = cut(target, args.layers)
    before = agreement(draft, target, held)
    print(f"bare cut: agreement {before:.1%} on held-out windows", flush=True)
    start = time.time()
    distill(draft, target, train_ids, args) if args.steps else None
    result = dict(
        params=sum(p.numel() for p in draft.parameters()),
        target_layers=target.config.num_hidden_layers,
        train_tokens=len(train_ids),
        seconds=time.time() - start,
        agreement_before=before,
        agreement_after=agreement(draft, target, held),
    )
    print(json.dumps(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(args.out)
    for name in COPIED:
        shutil.copyfile(args.target / name, args.out / name)
    write_card(args.out, args, result)


if __name__ == "__main__":
    main()
