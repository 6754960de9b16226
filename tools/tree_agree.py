"""Greedy tokens of two package trees on one model: do they agree? A variant tree (`tools/variant_tree.py`) that
changes kernels, not arithmetic, should give the tokens of the tree it was copied from.

    python tools/tree_agree.py OUT.json --tree-b .carry/v --model ~/.cache/minivllm/qwen3-0.6b-random

Each tree generates in its own process (PYTHONPATH = the tree, python -P), from the same random token prompts, at
each batch size (`--batches`), `--tokens` tokens each; the summary gives, per batch size, the share of sequences
whose tokens are identical and the first position where any differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GENERATE = """
import json, sys, random
from minivllm import LLM, SamplingParams
model, batches, tokens, out = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
llm = LLM(model, skip_tokenizer_init=True)
rng, result = random.Random(0), {}
for batch in batches:
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randrange(16, 256))] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result[batch] = [o.outputs[0].token_ids for o in outs]
llm.close()
json.dump(result, open(out, "w"))
"""


def generate(tree: Path, model: str, batches: str, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "tokens.json")
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [sys.executable, "-P", "-c", GENERATE, model, batches, str(tokens), out]
        subprocess.run(cmd, env=env, check=True, timeout=600)
        return json.load(open(out))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tree-a", type=Path, default=ROOT)
    ap.add_argument("--tree-b", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    a = generate(args.tree_a, args.model, args.batches, args.tokens)
    b = generate(args.tree_b, args.model, args.batches, args.tokens)
    summary = {}
    for batch in a:
        diffs = [first_difference(x, y) for x, y in zip(a[batch], b[batch])]
        same = sum(d is None for d in diffs)
        summary[batch] = dict(
            sequences=len(diffs), identical=same, first_difference=min(filter(None.__ne__, diffs), default=None)
        )
    result = dict(
        tree_a=str(args.tree_a), tree_b=str(args.tree_b), model=args.model, tokens=args.tokens, batches=summary
    )
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
