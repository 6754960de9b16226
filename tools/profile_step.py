"""Where does a step's time go? torch.profiler over prefill and decode steps of minivllm on a GPU.

    python tools/profile_step.py [--model PATH] [--batch 256] [--context 1024] [--steps 8] [--eager]
    python tools/profile_step.py --shared-prefix 1024 --context 300    # prompts = one shared 1,024-token prefix + 300
    python tools/profile_step.py --kv-cache-dtype fp8 --attention-backend triton   # an 8-bit cache, Triton kernels only

Builds an LLM on the model (default: Qwen3-0.6B with random weights, see minivllm.bench), warms it up on two prompts,
admits `--batch` requests of `--context` random prompt tokens and profiles the first step (prompts only: its GPU time
against the FLOP bound of its matrix products and causal attention, for a dense model's fresh prompts), runs until
every prompt is prefilled, then profiles `--steps` decode steps. Prints the top kernels by GPU time, the GPU time per
step, and the host (CPU) time of the engine's Python per step; `--out` writes both steps' kernels.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench import environment, random_qwen3_folder
from minivllm.bench.card import H200_FLOPS, card_line, measure_card
from minivllm.engine.step_inputs import StepInputs

PHASES = [  # (label, owner, attribute): the host work of one decode step, phase by phase
    ("scheduling: plan the next step (plan_lookahead)", "engine_module", "plan_lookahead"),
    ("input preparation (BatchBuilder.build)", "builder", "build"),
    ("graph replay: fill the pinned buffer, copy, launch", "graphs", "replay"),
    ("  of which cudaGraphLaunch (the driver)", "cuda_graph_class", "replay"),
    ("  of which the buffer fill (GraphInputs.load)", "graph_inputs", "load"),
    ("    of which the arrays into pinned memory (StepInputs.write)", "step_inputs_class", "write"),
    ("logits launch (lm_head)", "model", "compute_logits"),
    ("sampler launch", "runner", "sampler"),
    ("bookkeeping: tokens into sequences, stop rules (postprocess)", "scheduler", "postprocess"),
    ("outputs (OutputProcessor.process)", "outputs", "process"),
]


def host_breakdown(engine, steps: int) -> None:
    "Time each phase of the host's work per decode step by wrapping the methods that do it (wall-clock, no profiler)."
    import minivllm.engine.llm_engine as engine_module

    runner = engine.executor.runner
    owners = dict(
        scheduler=engine.scheduler,
        runner=runner,
        engine_module=engine_module,
        builder=engine.builder,
        graphs=runner.graphs,
        cuda_graph_class=torch.cuda.CUDAGraph,
        model=runner.model,
        graph_inputs=runner.graphs and runner.graphs.inputs,
        step_inputs_class=StepInputs,
        outputs=engine.outputs,
    )
    totals, originals = {}, []
    for label, owner_name, attr in PHASES:
        owner = owners[owner_name]
        if owner is None:
            continue
        fn = getattr(owner, attr)
        totals[label] = 0.0

        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] += time.perf_counter() - t0

        originals.append((owner, attr, attr in vars(owner), vars(owner).get(attr)))
        setattr(owner, attr, timed)
    trace, start = engine.start_trace(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall, waits, engine.trace = time.perf_counter() - start, [r.wait for r in trace], None
    for owner, attr, own, original in reversed(originals):
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)
    host = (wall - sum(waits)) / steps
    print(f"host time per decode step at batch {len(engine.scheduler.running)}: {host * 1e3:.3f} ms, by phase:")
    for label, total in totals.items():
        print(f"  {label:62} {total / steps * 1e3:.3f} ms")
    rest = host - sum(t for label, t in totals.items() if not label.startswith("  ")) / steps
    print(f"  {'the rest (engine.step, outputs, collect without the wait)':62} {rest * 1e3:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (prefix caching)")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--attention-backend", choices=["torch", "triton", "flash_attn"], default=None)
    ap.add_argument("--out", default=None, help="write the decode step's kernels (per step) to this JSON file")
    args = ap.parse_args()
    peaks = measure_card()  # the bound at the card's own matrix rate (and, for comparison, at the H200's)
    print(card_line(peaks))
    model = args.model or random_qwen3_folder("/tmp/minivllm-qwen3-0.6b-random")
    llm = LLM(
        model,
        skip_tokenizer_init=True,
        enforce_eager=args.eager,
        max_model_len=4096,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
    )
    engine = llm.llm_engine
    random.seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 4 + 64, ignore_eos=True)
    prefix = [random.randint(0, 10000) for _ in range(args.shared_prefix)]
    warm = [[random.randint(0, 10000) for _ in range(args.context)] for _ in range(2)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # kernels compiled before
    for _ in range(args.batch):
        engine.add_request(None, prefix + [random.randint(0, 10000) for _ in range(args.context)], params)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # the first step: prompts only
        engine.step()
        torch.cuda.synchronize()
    prefill_steps, prompt_lens = 1, prefill_composition(engine)
    events, prefill_us = prof.key_averages(), sum(t for _, t in kernel_totals(prof).values())
    bound_ms, h200_ms = (prefill_bound_ms(engine, prompt_lens, f) for f in (peaks["flops"], H200_FLOPS))
    print(
        f"one prefill step ({sum(prompt_lens)} tokens of {len(prompt_lens)} prompts): GPU kernels "
        f"{prefill_us / 1e3:.2f} ms against {bound_ms:.2f} ms for its matrix products and attention at the measured "
        f"{peaks['flops'] / 1e12:.0f} TFLOP/s = {prefill_us / 1e3 / bound_ms:.2f}x ({h200_ms:.2f} ms at the H200's "
        f"{H200_FLOPS / 1e12:.0f}: {prefill_us / 1e3 / h200_ms:.2f}x)"
    )
    prefill = dict(
        tokens=sum(prompt_lens),
        prompts=len(prompt_lens),
        gpu_ms=prefill_us / 1e3,
        bound_ms=bound_ms,
        h200_bound_ms=h200_ms,
        peaks=peaks,
        kernels=kernel_rows(prof, 1),
    )
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    while any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)
    ):
        engine.step()
        prefill_steps += 1
    torch.cuda.synchronize()
    print(
        f"prefill of {args.batch} x {args.context} tokens: {prefill_steps} steps, {time.perf_counter() - start:.3f} s"
    )
    for _ in range(4):  # warm decode
        engine.step()
    torch.cuda.synchronize()
    trace, start = engine.start_trace(), time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    waits, engine.trace = [r.wait for r in trace], None
    wall = (time.perf_counter() - start) / args.steps
    print(
        f"decode at batch {len(engine.scheduler.running)}: {wall * 1e3:.2f} ms/step wall, "
        f"host {(wall - sum(waits) / len(waits)) * 1e3:.2f} ms/step (wall minus the wait for the GPU)"
    )
    host_breakdown(engine, args.steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    totals = kernel_totals(prof).values()
    gpu_total, kernels = sum(t for _, t in totals) / args.steps, sum(c for c, _ in totals) / args.steps
    layers = engine.config.hf_config.num_hidden_layers
    busy = busy_us(prof) / args.steps
    print(
        f"GPU time per decode step (sum of kernels): {gpu_total / 1e3:.2f} ms; {kernels:.0f} kernels per step, "
        f"{kernels / layers:.1f} per layer ({layers} layers); busy (their union: less where kernels launched early "
        f"overlap) {busy / 1e3:.2f} ms"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if args.out:
        write_kernels(args, prof, wall, layers, prefill, busy)
    llm.close()


def prefill_composition(engine) -> list[int]:
    "The prompt tokens each sequence computed in the step just run (all prompts: the first step of a fresh batch)."
    return [s.num_computed_tokens for s in engine.scheduler.running if s.num_computed_tokens]


def prefill_bound_ms(engine, prompt_lens: list[int], flops: float) -> float:
    """Milliseconds for a prefill step's matrix products (2 FLOPs per weight per token, every layer, the LM head for
    one row per prompt) and causal attention (QK^T and PV over the positions each token sees) at `flops` FLOP/s."""
    cfg, model = engine.config.hf_config, engine.executor.runner.model
    layer_weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n)
    head = cfg.vocab_size * cfg.hidden_size
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    attention = 4 * pairs * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    total = 2 * sum(prompt_lens) * layer_weights + 2 * len(prompt_lens) * head + attention
    return total / flops * 1e3


def kernel_events(prof) -> list:
    "The GPU kernels the profiler saw (copies and memsets left out)."
    return [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]


def kernel_totals(prof) -> dict[str, list[float]]:
    "Launches and GPU microseconds per kernel name (each kernel once: key_averages would add the op launching it too)."
    totals: dict[str, list[float]] = {}
    for e in kernel_events(prof):
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    return totals


def busy_us(prof) -> float:
    "Microseconds during which at least one kernel ran: the union of their intervals (MINIVLLM_PDL=1 overlaps them)."
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernel_events(prof)):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy


def kernel_rows(prof, steps: int) -> list[dict]:
    "Per step: each kernel's name, launches and GPU microseconds, the costliest first."
    return sorted(
        ({"name": n, "launches": c / steps, "us": t / steps} for n, (c, t) in kernel_totals(prof).items()),
        key=lambda r: -r["us"],
    )


def write_kernels(args, prof, wall: float, layers: int, prefill: dict, busy: float) -> None:
    "The profiled decode steps' kernels per step, and the prefill step's (results file for notebooks 06 and 13)."
    with open(args.out, "w") as f:
        json.dump(
            dict(
                batch=args.batch,
                context=args.context,
                steps=args.steps,
                layers=layers,
                decode_step_ms_wall=wall * 1e3,
                gpu_busy_ms_per_step=busy / 1e3,
                environment=environment(),
                kernels=kernel_rows(prof, args.steps),
                prefill_step=prefill,
            ),
            f,
            indent=1,
        )
    print(f"kernels written to {args.out}")


if __name__ == "__main__":
    main()
