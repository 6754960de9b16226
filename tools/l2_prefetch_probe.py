"""Would a small-batch decode step run faster if each layer's weights were already in the L2 cache? A probe.

    python tools/l2_prefetch_probe.py OUT.json [--batches 1 8 32 128] [--context 1024]
    TRITON_INTERPRET=1 python tools/l2_prefetch_probe.py --check     # the prefetch kernel's addresses, on the CPU

Why: at batch 8 the step's matrix products take about twice their weights' time at full bandwidth (cuBLAS kernels of
5 to 8 us, figures/52_decode_kernels_b8_h100.json), while attention, norms and the activation use the memory system
only part of their time. Here a second CUDA stream, captured into the same graphs, issues `prefetch.global.L2` for
the weights ahead of the kernels that read them: at a layer's start its o, gate/up and down weights; at its MLP the
next layer's qkv weight. The main stream never waits for it inside the step, so the prefetch can only overlap.

Each arm is a fresh process (the patch goes in before the engine captures its graphs): `off`, `normal` (plain
prefetches) and `last` (`L2::evict_last`, kept over streamed data), alternated `--runs` times; each run times
`--steps` decode steps per batch size after prefill and warm-up, wall clock (the engine's own loop, graphs replayed).
A mode `last:64` runs 64 prefetching programs instead of `--programs`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

LINE = 128  # bytes an L2 line holds: one prefetch each


@triton.jit
def _prefetch_kernel(ptr, n_lines, BLOCK: tl.constexpr, LAST: tl.constexpr, DRY: tl.constexpr, out_ptr):
    "Each program walks lines `pid, pid + programs, ...` in blocks of BLOCK lines, one prefetch per line."
    start, step = tl.program_id(0) * BLOCK, tl.num_programs(0) * BLOCK
    for first in range(start, n_lines, step):
        lines = first + tl.arange(0, BLOCK)
        addr = ptr + tl.minimum(lines, n_lines - 1).to(tl.int64) * 128  # (past the end: the last line again)
        if DRY:  # on the CPU: store the line numbers this program would prefetch
            tl.store(out_ptr + lines, lines, mask=lines < n_lines)
        elif LAST:
            tl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;",
                "=r,l",
                [addr],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1];\n mov.u32 $0, 0;",
                "=r,l",
                [addr],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )


def prefetch(tensors: list[torch.Tensor], last: bool, programs: int = 16) -> None:
    "Ask the L2 cache for every line of `tensors` (contiguous), without waiting for them."
    for t in tensors:
        t = t.reshape(-1).view(torch.uint8)
        n = triton.cdiv(t.numel(), LINE)
        _prefetch_kernel[(min(programs, triton.cdiv(n, 256)),)](t, n, 256, last, False, t, num_warps=4)


def check() -> None:
    "Every line of a tensor is visited once (the interpreter runs the DRY branch)."
    for n in (1, 300, 5000):
        out = torch.full((n,), -1, dtype=torch.int32)
        for programs in (1, 3, 16):
            out.fill_(-1)
            _prefetch_kernel[(programs,)](out, n, 256, False, True, out)
            assert torch.equal(out, torch.arange(n, dtype=torch.int32)), (n, programs)
    print("prefetch kernel: every line once")


def patch(mode: str, programs: int) -> None:
    "Replace Qwen3DecoderLayer.forward (many-row path) by one that prefetches on a side stream."
    from minivllm.models import qwen3

    side = torch.cuda.Stream()
    last = mode == "last"
    original = qwen3.Qwen3DecoderLayer.forward

    def forward(self, positions, hidden_states, residual, meta=None):
        if hidden_states.shape[0] > 512:  # prompts: as before
            return original(self, positions, hidden_states, residual, meta)
        main = torch.cuda.current_stream()
        attn, mlp = self.self_attn, self.mlp
        if self.norms_in_products(hidden_states):  # one row: everything this layer and the next qkv, at its start
            side.wait_stream(main)
            ahead = [attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
            ahead += [self.next_layer.self_attn.qkv_proj.weight] if self.next_layer is not None else []
            with torch.cuda.stream(side):
                prefetch(ahead, last, programs)
            out = original(self, positions, hidden_states, residual, meta)
            if self.next_layer is None:
                main.wait_stream(side)
            return out
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch([attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight], last, programs)
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        if self.next_layer is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch([self.next_layer.self_attn.qkv_proj.weight], last, programs)
        out = self.mlp(hidden_states)
        if self.next_layer is None:
            main.wait_stream(side)  # the step's end joins the side stream
        return out, residual

    qwen3.Qwen3DecoderLayer.forward = forward
    init = qwen3.Qwen3Model.__init__

    def model_init(self, *a, **k):
        init(self, *a, **k)
        layers = list(self.layers)
        for layer, nxt in zip(layers, layers[1:] + [None]):
            object.__setattr__(layer, "next_layer", nxt)  # (not a submodule: its weights stay where they are)

    qwen3.Qwen3Model.__init__ = model_init


def one_run(mode: str, batches: list[int], context: int, steps: int, programs: int) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.bench import random_qwen3_folder

    mode, _, count = mode.partition(":")  # e.g. "last:64": 64 prefetching programs instead of --programs
    if mode != "off":
        patch(mode, int(count or programs))
    llm = LLM(random_qwen3_folder("/tmp/minivllm-qwen3-0.6b-random"), skip_tokenizer_init=True, max_model_len=4096)
    engine, out = llm.llm_engine, {}
    random.seed(0)
    for batch in batches:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(None, [random.randint(0, 10000) for _ in range(context)], params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or len(
            engine.scheduler.waiting
        ):
            engine.step()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        out[str(batch)] = (time.perf_counter() - start) / steps * 1e3
        while engine.has_unfinished_requests():
            engine.step()
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one arm, one run
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["off", "normal", "last"])
    args = ap.parse_args()
    if args.check:
        return check()
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one, args.batches, args.context, args.steps, args.programs)))
        return
    from minivllm.bench import environment

    runs = {m: [] for m in args.modes}
    for r in range(args.runs):
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--one", mode, "--context", str(args.context), "--steps", str(args.steps)]
            cmd += ["--programs", str(args.programs), "--batches", *map(str, args.batches)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=300)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not lines:
                print(mode, "failed:", proc.stderr[-2000:], flush=True)
                continue
            runs[mode].append(json.loads(lines[-1][7:]))
            print(f"run {r} {mode}: " + json.dumps(runs[mode][-1]), flush=True)
            medians = {m: {b: statistics.median(x[b] for x in rs) for b in rs[0]} for m, rs in runs.items() if rs}
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(environment=environment(), args=vars(args), runs=runs, medians=medians), f, indent=1)
    print("median ms per decode step:", json.dumps(medians))


if __name__ == "__main__":
    main()
