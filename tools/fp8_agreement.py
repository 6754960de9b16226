"""How close an 8-bit KV cache stays to the model's own dtype: greedy tokens and next-token distributions.

    python tools/fp8_agreement.py                       # the embedded model in bfloat16 on the GPU
    python tools/fp8_agreement.py --dtype float32 --device cpu

8 prompts x 32 greedy tokens with `kv_cache_dtype="auto"` and `"fp8"`: the share of tokens that come out the same,
and the mean KL divergence of the next-token distributions over each step's top 20 tokens, at the steps whose context
is still the same in both runs (as tests/test_kv_fp8.py and deep dive 13 measure it on the CPU). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math

import minivllm
from minivllm import LLM, TINY_MODEL_PATH, SamplingParams

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, x):\n",
    "for i in range(10):\n",
    "    return",
    "try:\n    import json\nexcept ImportError:\n",
    "x = [",
    "def main():\n",
]


def agreement(model: str = TINY_MODEL_PATH, dtype: str = "bfloat16", device: str = "cuda", **engine_kwargs) -> dict:
    "Share of greedy tokens the same, mean KL (nats) and KV blocks, 8-bit cache against the model's dtype."
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20)
    memory = dict(gpu_memory_utilization=0.3) if device == "cuda" else dict(cpu_kvcache_space_gib=0.05)
    runs, blocks = {}, []
    for kv in ["auto", "fp8"]:
        with LLM(model, dtype=dtype, device=device, kv_cache_dtype=kv, **memory, **engine_kwargs) as llm:
            runs[kv] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            blocks.append(llm.llm_engine.scheduler.block_manager.num_blocks)
    same, kls = 0, []
    for ref, got in zip(runs["auto"], runs["fp8"]):
        same += sum(a == b for a, b in zip(ref.token_ids, got.token_ids))
        diverged = next((t for t, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), 32)
        for t in range(min(diverged + 1, 32)):  # the same context up to here: the next-token distributions
            p, q = ref.logprobs[t], got.logprobs[t]
            kls.append(sum(math.exp(p[i].logprob) * (p[i].logprob - q[i].logprob) for i in p.keys() & q.keys()))
    total = sum(len(r.token_ids) for r in runs["auto"])
    return dict(share_same=same / total, mean_kl=sum(kls) / len(kls), steps=len(kls), blocks=blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TINY_MODEL_PATH)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    result = dict(package=minivllm.__file__, dtype=args.dtype, device=args.device)
    print(json.dumps(dict(result, **agreement(args.model, args.dtype, args.device))))


if __name__ == "__main__":
    main()
