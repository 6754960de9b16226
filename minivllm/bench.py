"""The standard benchmark of minivllm on a GPU, its roofline bound, and transformers' continuous batching side by side.

    python -m minivllm.bench                                  # 256 requests, prompts 100-1024, outputs 100-1024 tokens
    python -m minivllm.bench --compare transformers --compare-num-seqs 64 --compare-max-output 256
    python -m minivllm.bench --prefix                         # 256 requests sharing a 1,024-token prefix, cache on/off
    python -m minivllm.bench --model /path/to/Qwen3-0.6B --out results.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  bos_token_id=151643, eos_token_id=151645)

# %%
def standard_workload(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024, seed: int = 0,
                      min_input: int = 100, min_output: int = 100) -> tuple[list[list[int]], list[int]]:
    "The standard benchmark: random prompts of 100..max_input token ids, then 100..max_output output lengths."
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_input, max_input))]
               for _ in range(num_seqs)]
    outputs = [random.randint(min_output, max_output) for _ in range(num_seqs)]
    return prompts, outputs


def shared_prefix_workload(num_seqs: int = 256, prefix_len: int = 1024, own: tuple[int, int] = (100, 400),
                           max_output: int = 128, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    "Requests that share one long prefix (a system prompt, a document), then their own tokens."
    random.seed(seed)
    prefix = [random.randint(0, 10000) for _ in range(prefix_len)]
    prompts = [prefix + [random.randint(0, 10000) for _ in range(random.randint(*own))] for _ in range(num_seqs)]
    return prompts, [max_output] * num_seqs

# %%
def roofline(config: dict, prompt_lens: list[int], output_lens: list[int], bandwidth: float = 4.3e12,
             flops: float = 790e12, bytes_per_param: int = 2) -> dict:
    """Lower bound on the benchmark's time (the formula of the project's shared roofline tool): prefill at the
    matrix rate; each decode step at least moves the weights and every running sequence's KV cache."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    qd, kvd = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    per_layer = h * (qd + 2 * kvd) + qd * h + 3 * h * config["intermediate_size"]
    matmul_params = layers * per_layer + vocab * h
    weight_bytes = (matmul_params + (0 if config.get("tie_word_embeddings") else vocab * h)) * bytes_per_param
    kv_per_token = layers * 2 * kvd * bytes_per_param
    attn_flops = 4 * layers * qd
    prefill = (sum(prompt_lens) * 2 * matmul_params + sum(attn_flops * n * n / 2 for n in prompt_lens)) / flops
    decode = 0.0
    for step in range(max(output_lens)):
        ctx = [p + step for p, o in zip(prompt_lens, output_lens) if o > step]
        decode += max((weight_bytes + sum(ctx) * kv_per_token) / bandwidth,
                      (len(ctx) * 2 * matmul_params + sum(ctx) * attn_flops) / flops)
    total = prefill + decode
    return dict(prefill_s=prefill, decode_s=decode, total_s=total, max_output_tok_s=sum(output_lens) / total)

# %%
def random_qwen3_folder(path: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides) -> str:
    """Write the Qwen3-0.6B architecture with seeded RANDOM weights as a Hugging Face folder (config.json,
    model.safetensors, a README saying so) and return its path. Reused when it already holds the same config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    spec = {**QWEN3_0_6B, **overrides}
    marker = os.path.join(path, "minivllm_random_weights.json")
    wanted = dict(spec=spec, seed=seed, dtype=str(dtype))
    if os.path.isfile(marker) and json.load(open(marker)) == wanted:
        return path
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**spec)).to(dtype)
    model.save_pretrained(path)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write("# RANDOM WEIGHTS\n\nThe Qwen3-0.6B architecture with seeded random weights, written by "
                "`minivllm.bench.random_qwen3_folder` for speed measurements. It generates noise.\n")
    json.dump(wanted, open(marker, "w"))
    del model
    gc.collect()
    return path

# %%
@dataclass
class BenchResult:
    "One measured run."
    engine: str
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def line(self) -> str:
        return (f"{self.engine:14} {self.workload:22} {self.num_requests:4d} requests, {self.prompt_tokens:7,} prompt + "
                f"{self.output_tokens:7,} output tokens in {self.seconds:7.2f} s = {self.output_tok_s:9,.0f} output tok/s")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()

# %%
def run_minivllm(model: str, prompts: list[list[int]], output_lens: list[int], workload: str = "standard",
                 temperature: float = 0.0, trace: bool = True, **engine_kwargs) -> tuple[BenchResult, list]:
    "Time `LLM.generate` on the workload (after a short warm-up); return the result and the per-step trace."
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams
    engine_kwargs.setdefault("skip_tokenizer_init", not os.path.isfile(os.path.join(model, "tokenizer.json")))
    llm = LLM(model, **engine_kwargs)
    try:
        warm = [p[:128] for p in prompts[:8]]
        llm.generate(warm, SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True), use_tqdm=False)
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in output_lens]
        _sync()
        records = llm.llm_engine.start_trace() if trace else []
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
        seconds = time.perf_counter() - start
        stats = llm.llm_engine.scheduler
        result = BenchResult("minivllm", workload, len(prompts), sum(map(len, prompts)),
                             sum(len(o.outputs[0].token_ids) for o in outputs), seconds,
                             dict(preemptions=stats.num_preemptions, steps=llm.llm_engine.stats.num_steps,
                                  cached_prompt_tokens=sum(o.num_cached_tokens for o in outputs),
                                  engine_kwargs={k: v for k, v in engine_kwargs.items()}))
        return result, records
    finally:
        llm.close()
        del llm
        gc.collect()


def run_transformers(model: str, prompts: list[list[int]], output_lens: list[int], workload: str = "standard",
                     dtype: torch.dtype = torch.bfloat16) -> BenchResult:
    "Time transformers' own continuous batching (paged SDPA) on the same workload, eos disabled."
    from transformers import AutoModelForCausalLM, GenerationConfig
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to("cuda").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens), eos_token_id=-1, pad_token_id=0)
    results = {}
    with hf.continuous_batching_context_manager(generation_config=config, block=True) as manager:
        _sync()
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, output_lens)]
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing the workload")
        _sync()
        seconds = time.perf_counter() - start
    errors = [o.error for o in results.values() if o.error]
    if errors:
        raise RuntimeError(f"transformers failed {len(errors)} requests: {errors[0]}")
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return BenchResult("transformers", workload, len(prompts), sum(map(len, prompts)),
                       sum(len(o.generated_tokens) for o in results.values()), seconds)

# %%
def environment() -> dict:
    import platform

    import triton
    import transformers
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               triton=triton.__version__, cpu_count=os.cpu_count())
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count())
    return env


def host_time_per_decode_step(records: list, min_running: int) -> float | None:
    "Median host time (step time minus the wait for the GPU's result) of decode steps of >= `min_running` sequences."
    times = sorted(r.duration - r.wait for r in records if r.is_decode_only and len(r.seq_ids) >= min_running)
    return times[len(times) // 2] if times else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Qwen3 checkpoint folder (default: Qwen3-0.6B, random weights)")
    ap.add_argument("--random-model-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "minivllm",
                                                               "qwen3-0.6b-random"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--compare", choices=["transformers"], default=None,
                    help="also run transformers' continuous batching on the same (or the --compare-*) workload")
    ap.add_argument("--compare-num-seqs", type=int, default=None, help="a smaller workload for the side by side")
    ap.add_argument("--compare-max-input", type=int, default=None)
    ap.add_argument("--compare-max-output", type=int, default=None)
    ap.add_argument("--prefix", action="store_true", help="the shared-prefix workload, prefix caching on and off")
    ap.add_argument("--skip-standard", action="store_true", help="skip the standard workload")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline (H200 copy: 4.3e12)")
    ap.add_argument("--flops", type=float, default=790e12, help="FLOP/s for the roofline (H200 bf16: 790e12)")
    ap.add_argument("--out", default=None, help="write the results (and step traces) to this JSON file")
    return ap.parse_args(argv)

# %%
class Report:
    "The benchmark's results: each run printed as it comes, and kept for the JSON file."

    def __init__(self, **info):
        self.data = dict(info, runs=[])

    def add(self, result: BenchResult, bound: dict | None = None, trace: list | None = None) -> None:
        line, entry = result.line(), dict(asdict(result), output_tok_s=result.output_tok_s)
        if bound:
            entry["roofline"] = bound
            entry["fraction_of_bound"] = result.output_tok_s / bound["max_output_tok_s"]
            line += f" = {entry['fraction_of_bound']:.1%} of the bound ({bound['max_output_tok_s']:,.0f})"
        if trace:
            entry["host_ms_per_decode_step_at_batch_256"] = (host_time_per_decode_step(trace, 256) or 0) * 1e3
            entry["trace"] = [dict(t=r.start, step_s=r.duration, wait_s=r.wait, batch=len(r.seq_ids),
                                   running=r.num_running, waiting=r.num_waiting, kv_usage=r.kv_usage,
                                   decode_only=r.is_decode_only) for r in trace]
        print(line, flush=True)
        self.data["runs"].append(entry)

# %%
def run_workloads(args: argparse.Namespace, model: str, spec: dict, engine_kwargs: dict, report: Report) -> None:
    "The standard workload (with its bound), then the side by side with transformers and the shared prefix, if asked."
    if not args.skip_standard:
        prompts, outs = standard_workload(args.num_seqs, args.max_input, args.max_output, args.seed)
        bound = roofline(spec, list(map(len, prompts)), outs, args.bandwidth, args.flops)
        result, trace = run_minivllm(model, prompts, outs, "standard", args.temperature, **engine_kwargs)
        report.add(result, bound, trace)
        host = host_time_per_decode_step(trace, 256)
        if host is not None:
            print(f"host time per decode step at batch 256: {host * 1e3:.2f} ms (median)")
    if args.compare:
        prompts, outs = standard_workload(args.compare_num_seqs or args.num_seqs, args.compare_max_input or
                                          args.max_input, args.compare_max_output or args.max_output, args.seed)
        ours, _ = run_minivllm(model, prompts, outs, "side-by-side", args.temperature, trace=False, **engine_kwargs)
        theirs = run_transformers(model, prompts, outs, "side-by-side")
        report.add(ours), report.add(theirs)
        report.data["compare_ratio"] = ours.output_tok_s / theirs.output_tok_s
        print(f"minivllm / transformers continuous batching: {report.data['compare_ratio']:.1f}x")
    if args.prefix:
        prompts, outs = shared_prefix_workload(seed=args.seed)
        on, _ = run_minivllm(model, prompts, outs, "shared-prefix, cache on", trace=False, **engine_kwargs)
        off, _ = run_minivllm(model, prompts, outs, "shared-prefix, cache off", trace=False,
                              **{**engine_kwargs, "enable_prefix_caching": False})
        report.add(on), report.add(off)
        report.data["prefix_cache_speedup"] = on.output_tok_s / off.output_tok_s
        print(f"prefix caching on / off: {report.data['prefix_cache_speedup']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("the GPU benchmark needs a CUDA device; on a CPU, see tools/cpu_bench.py", file=sys.stderr)
        return 2
    model = args.model or random_qwen3_folder(args.random_model_dir)
    from transformers import AutoConfig
    print(f"model: {model}{'' if args.model else ' (RANDOM WEIGHTS)'}\nenvironment: {environment()}")
    engine_kwargs = dict(tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                         block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    report = Report(model=model, random_weights=not args.model, environment=environment(), args=vars(args))
    run_workloads(args, model, AutoConfig.from_pretrained(model).to_dict(), engine_kwargs, report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report.data, f, indent=1)
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__" and "ipykernel" not in sys.modules:
    sys.exit(main())
