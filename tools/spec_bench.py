"""Speculative decoding on a GPU with the tiny model (issue 51): greedy outputs with n-gram and draft-model speculation
token-identical to plain decoding (float32 and bfloat16), acceptance, and single-stream / batch-8 output tok/s of four
engines alternating, medians of 3: plain, n-gram, n-gram forced to reject every guess (k guesses whenever the engine
asks, none accepted: a request backs off after two fruitless verify steps in a row), the same verifying at every step
(no backing off: the cost of a verify step), and the draft model.

    python tools/spec_bench.py OUT.json
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minivllm import LLM, TINY_DRAFT_PATH, TINY_MODEL_PATH, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tools")]
from _spec_prompts import PROMPTS, SPEC  # noqa: E402
from forced_reject import forced  # noqa: E402

DRAFT = {"method": "draft_model", "model": TINY_DRAFT_PATH, "num_speculative_tokens": 3}
CONFIGS = {"plain": None, "ngram": SPEC, "forced_reject": SPEC, "forced_reject_always": SPEC, "draft": DRAFT}
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
for dtype in ("float32", "bfloat16"):
    outs = {}
    for m in ("plain", "ngram", "draft"):
        with LLM(TINY_MODEL_PATH, device="cuda", dtype=dtype, speculative_config=CONFIGS[m]) as llm:
            outs[m] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
            st = llm.llm_engine.stats
            if m != "plain":
                res[f"{dtype}_{m}_acceptance"] = [
                    st.num_spec_drafts,
                    st.num_spec_draft_tokens,
                    st.num_spec_accepted_tokens,
                ]
                res[f"{dtype}_{m}_same"] = [a == b for a, b in zip(outs["plain"], outs[m])]
                print(
                    dtype,
                    m,
                    "same tokens:",
                    res[f"{dtype}_{m}_same"],
                    "drafts/draft tokens/accepted:",
                    res[f"{dtype}_{m}_acceptance"],
                    flush=True,
                )

code = PROMPTS[2] * 3
modes = ("plain", "ngram", "forced_reject", "forced_reject_always", "draft")
llms = {m: LLM(TINY_MODEL_PATH, device="cuda", speculative_config=CONFIGS[m], num_kvcache_blocks=2048) for m in modes}
timing = {}
for batch in (1, 8):
    p = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    runs, toks = {m: [] for m in modes}, {}
    for m in modes:
        forced(m)
        toks[m] = [o.outputs[0].token_ids for o in llms[m].generate([code] * batch, p, use_tqdm=False)]  # warm-up
    for _ in range(3):
        for m in modes:
            forced(m)
            t = time.perf_counter()
            outs = llms[m].generate([code] * batch, p, use_tqdm=False)
            dt = time.perf_counter() - t
            runs[m].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    forced("plain")
    row = {f"{m}_tok_s": statistics.median(runs[m]) for m in modes}
    row.update(runs=runs, same_tokens={m: toks[m] == toks["plain"] for m in modes})
    row.update({f"{m}_ratio": row[f"{m}_tok_s"] / row["plain_tok_s"] for m in modes[1:]})
    timing[batch] = row
    ratios = ", ".join(f"{m} {row[m + '_tok_s']:.0f} ({row[m + '_ratio']:.2f}x)" for m in modes[1:])
    print(f"batch {batch}: plain {row['plain_tok_s']:.0f} tok/s, {ratios}, same {row['same_tokens']}", flush=True)
st = llms["ngram"].llm_engine.stats
res["timing_acceptance_ngram"] = [st.num_spec_drafts, st.num_spec_draft_tokens, st.num_spec_accepted_tokens]
st = llms["draft"].llm_engine.stats
res["timing_acceptance_draft"] = [st.num_spec_drafts, st.num_spec_draft_tokens, st.num_spec_accepted_tokens]
res["timing"] = timing
json.dump(res, open(sys.argv[1], "w"), indent=1)
