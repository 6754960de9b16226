"""The shape of the course and the package: the longest notebook code cells, the largest files, the longest functions.

    python tools/shape.py            # print the report; exit 1 when a limit is broken (`make test` runs it)

Limits: a notebook code cell <= 70 lines; a package file <= 300 lines; a Python function <= 60 lines (a Triton
kernel, decorated with `triton.jit`, <= 80); the runtime package (every module but the drawing modules `viz*` and the
benchmark modules `bench*`) no larger than its budget: the redesign (project issue 12) kept it at its size before,
4,779 lines, and each later feature adds the lines it measured, listed in RUNTIME_BUDGET, so that growth is a
decision someone wrote down, not drift.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CELL, MAX_FILE, MAX_FUNCTION, MAX_KERNEL = 70, 300, 60, 80
RUNTIME_BUDGET = {  # lines of the runtime package: what each step of the project added, as measured when it landed
    "issue 12, the redesign: the size before it": 4779,
    "issue 14, vLLM's sampling fields (penalties, min_tokens, logit_bias, allowed ids, bad words with a device-side "
    "token history; n samples; prompt_logprobs; Logprob), checkpoint defaults, Hub ids": 583,
    "issue 15, serving: AsyncLLM (engine thread, streams, output kinds), Prometheus metrics, the OpenAI-compatible "
    "server (protocol, errors, middleware, formats, routes), `minivllm serve`; n > 1 streams that end right": 918,
    "issue 19, more families: Qwen2/2.5, Llama 3 (its rotary scaling), Qwen3-MoE (router, experts, the fused Triton "
    "kernel with its reference), the decoder's traits, the experts' loader mapping, dummy weights": 397,
    "issue 17 (part), an 8-bit KV cache: kv_cache_dtype, the rounding store, the kernels' 8-bit reads": 31,
    "issue 17 (part), dummy weights as a random checkpoint: each layer's checkpoint_shape (also what its loader "
    "checks), dummy_checkpoint (whole tensors seeded by name, so every tensor-parallel size gets the same model)": 35,
    "issues 16/18 (part), the CPU path: reuse_freed_memory (glibc keeps freed memory for reuse), the CPU KV cache "
    "from the system's zero pages (so the CPU decode needs no pass that zeroes the values past each end)": 38,
    "issue 22, flash-attn-4: its paged and varlen calls (kernels/flash_attention.py), the backend chosen per phase "
    "from a table of measurements, the version and capability checks with their errors, prefill_backend": 108,
    "issue 18 (part), the CPU decode keeps a batch's K/V between steps (kernels/kept_decode_kv.py: the continuation "
    "check, gather, append, one SDPA call per group; the layer's use of it)": 97,
    "issue 18 (part), the CPU's matmuls on oneDNN's packed weights (linear(), cpu_packing_works, pack_for_cpu, "
    "each linear layer's and the LM head's packed_weight slot, the runner's call; products of <= 256 rows, padded "
    "to a power of two, since oneDNN keeps a kernel per input shape)": 45,
    "issue 16 (part), a layer's q/k norm, rotary embedding and KV write in one Triton kernel (kernels/qk_norm_rope.py "
    "with its launcher's checks; Qwen3Attention._one_kernel; Attention takes K/V already in the cache)": 113,
    "issue 16 (part), steps with prompt tokens in CUDA graphs per token bucket (engine/cuda_graph.py: "
    "mixed_token_sizes, MixedGraphRunner, GraphInputs' padding of spare tokens and sequences; the runner's choice)": 58,
    "issue 16 (part), a mixed step's one-token sequences on the decode kernel (MIXED / SKIP_SINGLE in the decode, "
    "merge and prefill kernels, the launchers' cu_seqlens_q / skip_single and checks, paged_attention's two calls; "
    "its lines wrapped to 120 columns)": 32,
    "issue 16 (part), one row's products on a GPU as a matrix-vector Triton kernel (kernels/gemv.py, with the MLP's "
    "activation fused into gate_up's; the dispatch in linear and Qwen3MLP)": 59,
    "issue 16 (part), the MLP's activation as a Triton kernel instead of the compiled expression "
    "(kernels/activation.py, silu_and_mul's dispatch)": 40,
    "issue 16 (part), the greedy pick recorded in the graphs (CUDAGraphRunner.head, greedy_ids, _sample's use)": 13,
    "issue 16 (part), the prefill kernel masks only the causal diagonal (_prefill_tiles called twice; the launchers' "
    "num_warps / num_stages)": 16,
    "issue 16 (part), a decode step of one sequence runs each norm inside the product after it (kernels/gemv.py: "
    "_norm_gemv_kernel, norm_gemv, the shared check_row; Qwen3DecoderLayer.norms_in_products and _one_row; "
    "Qwen3Attention.attend)": 71,
    "issue 16 (part), programmatic dependent launch for a decode step's kernels, off unless MINIVLLM_PDL=1 "
    "(kernels/common.py: use_pdl, pdl_launch_next, pdl_wait; the waits in five kernels and their launchers; gemv's "
    "first tile of weights loaded before the wait, _gemv_tile; a Triton without it launches plainly)": 63,
    "issue 16 (part), gemv launched early takes a whole row of up to 4,096 inputs per tile (gemv_tiles)": 11,
    "robustness: SamplingParams.n at most MAX_N; the server counts n samples of each prompt against its queue": 8,
    "robustness: the engine's seed in 64 bits; a KV cache that does not fit in memory is a ValueError naming "
    "num_kvcache_blocks": 5,
    "robustness: LLM.__del__ without contextlib (at interpreter exit the module's globals may be gone)": 1,
    "robustness, from fuzzing the server: min_tokens past int32 clamped where it is a tensor (it killed the engine); "
    "seed + n - 1 in 64 bits; logit_bias finite (OpenAI's [-100, 100] on the server); max_completion_tokens >= 1; "
    "no chat template from a request; prompt text must be valid Unicode": 17,
    "robustness, from fuzzing the command line and LLM: a refused value is one line and exit status 2 (python -m "
    "minivllm, minivllm serve: run, int_in); serve stops the engine first on SIGINT/SIGTERM (requests in flight: 503, "
    "not cancelled with tracebacks); chat_message (role, content, text parts); bytes are no prompt; a bad config.json "
    "field is a ValueError; stop / bad_words types": 62,
    "n > 1: the final output waits for every sample's last token to be booked (ParentRequest.ended; remove adds "
    "an aborted one)": 2,
    "AsyncLLM, from fuzzing it: commands and outputs addressed by the stream's token too (a reused id got another "
    "request's abort or outputs; a rejected id aborted another request's sample), streams held weakly (a loop left "
    "with break never aborted), an abort ends every sample and keeps the prompt": 29,
    "the command line refuses --no-thinking without --chat and prompts with --demo; an empty model path": 3,
    "the engine thread hands outputs to streams through weak references (a stream left with break goes at once, "
    "its id free); a chat template's own error is a ValueError": 5,
    "issue 45, an id free the moment its stream goes: the ids in use and each stream's route (its loop, a weak "
    "reference) kept apart, so the engine thread never holds a stream; _send, _release": 12,
    "issue 52 (part), early launch on by default for steps of one token row (PDL_MAX_ROWS, use_pdl's rows)": 2,
    "issue 46, GGUF files and a real model: models/gguf_loader.py (metadata -> config, llama.cpp's names, tensors "
    "dequantized one at a time, a Llama's q/k rows un-interleaved, the tokenizer), real_model.py (SmolLM2 fetched "
    "with pip, checked), is_gguf at the four boundaries, tokenizer=, --tokenizer, the demo on SmolLM2": 270,
    "issue 49, the server as real clients use it: echo and prompt_logprobs (lm-eval's loglikelihood), unknown fields "
    "ignored with a warning and REFUSED ones named, continuous_usage_stats, chat content as text parts, vLLM's v1 "
    "metric names (Twin aliases, success, phases, sizes, prefix cache) and gauges updated on abort, /tokenize, "
    "/detokenize, /version, /v1/models/{id}, max_tokens that cannot fit: 400 (AsyncLLM.generate's check, so "
    "nothing is queued); echo streamed": 168,
}
MAX_RUNTIME = sum(RUNTIME_BUDGET.values())
COURSE_ONLY = ("viz", "bench")  # module name prefixes of the drawing and benchmark code


def is_kernel(node: ast.FunctionDef) -> bool:
    "Decorated with `triton.jit` (or `triton.jit(...)`)."
    return any("triton.jit" in ast.unparse(d) for d in node.decorator_list)


def functions(path: Path) -> list[tuple[int, str, int]]:
    "(lines, where, limit) of every function and method of a module."
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (
            node.end_lineno - node.lineno + 1,
            f"{path.relative_to(ROOT)}:{node.lineno} {node.name}",
            MAX_KERNEL if is_kernel(node) else MAX_FUNCTION,
        )
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def code_cells(notebook: Path) -> list[tuple[int, str]]:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return [
        (len("".join(c["source"]).splitlines()), f"{notebook.name}[{i}]")
        for i, c in enumerate(cells)
        if c["cell_type"] == "code"
    ]


def report() -> list[str]:
    "Print the figures; return the broken limits."
    files = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted((ROOT / "minivllm").rglob("*.py"))}
    runtime = sum(n for p, n in files.items() if not p.stem.startswith(COURSE_ONLY))
    funcs = sorted((f for p in files for f in functions(p)), reverse=True)
    cells = sorted((c for nb in sorted((ROOT / "notebooks").glob("*.ipynb")) for c in code_cells(nb)), reverse=True)
    largest = sorted(files.items(), key=lambda item: -item[1])
    print(
        f"package: {sum(files.values())} lines in {len(files)} files; runtime (all but viz*, bench*): {runtime} "
        f"(limit {MAX_RUNTIME})"
    )
    print("largest files:", ", ".join(f"{p.relative_to(ROOT / 'minivllm')} {n}" for p, n in largest[:5]))
    print("longest functions:", ", ".join(f"{n} {where}" for n, where, _ in funcs[:5]))
    print("longest code cells:", ", ".join(f"{n} {where}" for n, where in cells[:5]))
    broken = [f"code cell {where}: {n} lines > {MAX_CELL}" for n, where in cells if n > MAX_CELL]
    broken += [f"{p.relative_to(ROOT)}: {n} lines > {MAX_FILE}" for p, n in files.items() if n > MAX_FILE]
    broken += [f"function {where}: {n} lines > {limit}" for n, where, limit in funcs if n > limit]
    if runtime > MAX_RUNTIME:
        broken.append(f"the runtime package has {runtime} lines > {MAX_RUNTIME}")
    return broken


if __name__ == "__main__":
    problems = report()
    print("shape: " + ("; ".join(problems) if problems else "within limits"))
    sys.exit(1 if problems else 0)
