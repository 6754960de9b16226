"""The cost of structured outputs per decode step: a batch of B requests decoding T tokens, free against constrained
by a JSON schema (one long string, so that no request can finish early), the mask filled while the device computes
(the engine's way) and filled before the step launches (the plain way), alternating, medians of `--runs`.

    python tools/structured_bench.py --batch 1 32 256 --tokens 64 --out figures/50_structured_cost_cpu.json
    python tools/structured_bench.py --device cuda --batch 1 32 256 --out figures/50_structured_cost_h100.json

A step's time is (T + 1 tokens - 1 token) / T: the prompt's step is left out. The cost is the constrained step's
time minus the free one's, in milliseconds, and as a ratio. The mask is filled on the host, row by row; on a GPU the
overlap hides that behind the forward pass, on a CPU (which runs the forward pass itself) nothing can.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.structured_outputs.params import StructuredOutputsParams

LONG_STRING = {  # a string of at least 2,000 characters: no constrained request ends within the measured tokens
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 2000, "maxLength": 4000}},
    "required": ["text"],
}


def timed(llm: LLM, batch: int, tokens: int, constrained: bool) -> float:
    spec = StructuredOutputsParams(json=LONG_STRING, disable_any_whitespace=True) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
    start = time.perf_counter()
    outs = llm.generate(["Write a long text:"] * batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return seconds


def step_ms(llm: LLM, batch: int, tokens: int, constrained: bool) -> float:
    return (timed(llm, batch, tokens + 1, constrained) - timed(llm, batch, 1, constrained)) / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TINY_MODEL_PATH)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=max(args.batch))
    config = llm.llm_engine.config
    result = {"model": args.model, "device": str(config.device), "vocab_size": config.hf_config.vocab_size, "rows": []}
    if str(config.device).startswith("cuda"):
        import torch

        result["gpu"] = torch.cuda.get_device_name()
    grammars = llm.llm_engine.grammars
    for batch in args.batch:
        step_ms(llm, batch, 4, True)  # warm-up: graphs, the grammar's compilation
        step_ms(llm, batch, 4, False)
        runs: dict[str, list[float]] = {"free": [], "constrained": [], "constrained_serial": []}
        for _ in range(args.runs):
            runs["free"].append(step_ms(llm, batch, args.tokens, False))
            runs["constrained"].append(step_ms(llm, batch, args.tokens, True))
            grammars.overlap = False
            runs["constrained_serial"].append(step_ms(llm, batch, args.tokens, True))
            grammars.overlap = True
        row: dict = {"batch": batch, **{f"{k}_ms": statistics.median(v) for k, v in runs.items()}, "runs": runs}
        row["cost_ms"] = row["constrained_ms"] - row["free_ms"]
        row["ratio"] = row["constrained_ms"] / row["free_ms"]
        row["serial_cost_ms"] = row["constrained_serial_ms"] - row["free_ms"]
        row["serial_ratio"] = row["constrained_serial_ms"] / row["free_ms"]
        result["rows"].append(row)
        print(
            f"batch {batch:4d}: free {row['free_ms']:7.3f} ms/step, constrained {row['constrained_ms']:7.3f} "
            f"ms/step: +{row['cost_ms']:.3f} ms ({row['ratio']:.2f}x); filled before the launch "
            f"+{row['serial_cost_ms']:.3f} ms ({row['serial_ratio']:.2f}x)",
            flush=True,
        )
    llm.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
