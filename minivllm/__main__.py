from __future__ import annotations

import argparse
import sys
import time

from .llm import LLM
from .sampling_params import SamplingParams
from .tiny_model import TINY_MODEL_PATH

DEMO_PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main():\n",
                "class Stack:\n    def __init__(self):\n        ", "for i, line in enumerate(lines):\n",
                "    def __repr__(self):\n        return", "try:\n    import json\nexcept ImportError:\n"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minivllm", description="Generate text with minivllm.")
    ap.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    ap.add_argument("--model", default=TINY_MODEL_PATH, help="a Qwen3 checkpoint folder (default: the tiny model)")
    ap.add_argument("--demo", action="store_true", help="complete a few code prompts and report the throughput")
    for flag, kind, default in (("--max-tokens", int, 64), ("--temperature", float, 0.0), ("--top-p", float, 1.0),
                                ("--top-k", int, -1), ("--min-p", float, 0.0), ("--seed", int, None)):
        ap.add_argument(flag, type=kind, default=default)   # the sampling parameters
    ap.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    ap.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    ap.add_argument("--no-stream", action="store_true", help="print a single prompt's completion at the end")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    return ap.parse_args(argv)

# %%
def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.demo:
        return DEMO_PROMPTS
    if args.prompts:
        return args.prompts
    return [] if sys.stdin.isatty() else [line.rstrip("\n") for line in sys.stdin if line.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = read_prompts(args)
    if not prompts:
        print("give prompts as arguments or one per line on stdin (or --demo)", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
    with LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
             enforce_eager=args.enforce_eager) as llm:
        if args.chat:
            template = llm.get_tokenizer().apply_chat_template
            prompts = [template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                       for p in prompts]
        start = time.perf_counter()
        if len(prompts) == 1 and not args.no_stream:
            print(prompts[0], end="", flush=True)
            n = 0
            for delta in llm.stream(prompts[0], params):
                print(delta.outputs[0].text, end="", flush=True)
                n += len(delta.outputs[0].token_ids)
            print()
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for out in outputs:
                print(f"--- {out.prompt!r}\n{out.prompt}{out.outputs[0].text}  [{out.outputs[0].finish_reason}]")
            n = sum(len(o.outputs[0].token_ids) for o in outputs)
        seconds = time.perf_counter() - start
    print(f"\n{len(prompts)} prompt(s), {n} tokens generated in {seconds:.2f} s: {n / seconds:,.0f} tok/s",
          file=sys.stderr)
    return 0


if __name__ == "__main__" and "ipykernel" not in sys.modules:  # not when this cell runs in the notebook
    sys.exit(main())
