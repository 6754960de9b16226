"""minivllm against transformers on a CPU: the same batch of greedy completions, throughput of each.

The workload (deterministic): `num_prompts` prompts of random token ids, lengths uniform in 32..256 and ids uniform
in [3, vocab_size) (0..2 are the tiny model's special tokens), drawn from `random.Random(seed)`; every prompt gets
exactly `max_tokens` greedy output tokens (end-of-sequence ignored).

- minivllm: `LLM(model, device="cpu").generate(prompts, SamplingParams(temperature=0, max_tokens=...,
  ignore_eos=True))`, float32, default engine settings (all the prompts fit in one step's token budget); the prefix
  cache is emptied before each run, so that no run reuses the prompts' K/V computed by the one before;
- transformers: one `model.generate` call on the prompts left-padded into one batch with an attention mask,
  `do_sample=False`, `max_new_tokens=min_new_tokens=max_tokens` and no eos token (so that greedy picks are never
  masked), float32, SDPA attention.

Each side runs in a process of its own, as it would in a user's program: minivllm's engine sets glibc's malloc to keep
freed memory for reuse (`reuse_freed_memory`, notebook 09), which is the whole process's setting and speeds up
transformers too. So transformers runs twice: as it comes, and in a process with the same setting
("transformers + reuse"), and the speedup is reported against both. Both use torch's default number of threads.
Each side is warmed up once, then timed `repeats` times, the sides alternating (so that a busy moment of a shared
machine hits all of them); the medians are reported, in output tokens per second. The greedy tokens are compared, too.

    python tools/cpu_bench.py                     # 64 prompts x 64 tokens, 5 timed runs each
    python tools/cpu_bench.py --num-prompts 16 --repeats 1
    python tools/cpu_bench.py --alone             # on a shared machine: time only runs nobody else disturbed

On a machine shared with other jobs, `--alone` waits for an idle moment before each timed run and repeats a run during
which other processes used more than 5% of a core (read from /proc/stat: Linux only).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402


def _others_cpu_seconds() -> float:
    "CPU seconds used so far by every process but this one (Linux: /proc/stat)."
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    everyone = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    me = os.times()
    return everyone - me.user - me.system


def timed_alone(fn, max_others: float = 0.05, timeout: float = 3600.0) -> float:
    """Wall time of one run of `fn` during which the other processes used less than `max_others` of a core on average:
    waits for an idle second before each try, retries a disturbed run (a machine shared with others; Linux only)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        before = _others_cpu_seconds()
        time.sleep(1.0)
        if _others_cpu_seconds() - before >= max_others:
            continue  # someone is busy: wait
        before, start = _others_cpu_seconds(), time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        if _others_cpu_seconds() - before < max_others * seconds:
            return seconds
    raise RuntimeError(f"the machine was never idle for a whole run within {timeout:.0f} s")


def random_prompts(
    num_prompts: int, vocab_size: int, seed: int = 0, min_len: int = 32, max_len: int = 256, first_id: int = 3
) -> list[list[int]]:
    "Prompts of random token ids, lengths uniform in [min_len, max_len], ids uniform in [first_id, vocab_size)."
    rng = random.Random(seed)
    return [
        [rng.randrange(first_id, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)
    ]


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def transformers_generate(model_path: str, prompts: list[list[int]], max_tokens: int):
    "A function that runs one batched greedy `generate` of transformers and returns the new token ids per prompt."
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids, mask = _left_pad(prompts, pad_id)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
        bos_token_id=None,
    )

    @torch.inference_mode()
    def generate() -> list[list[int]]:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return out[:, ids.shape[1] :].tolist()

    return generate


def minivllm_generate(model_path: str, prompts: list[list[int]], max_tokens: int, **engine_kwargs):
    "A function that runs one `LLM.generate` of minivllm and returns the new token ids per prompt (and the LLM)."
    from minivllm import LLM, SamplingParams

    llm = LLM(model_path, device="cpu", dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    block_manager = llm.llm_engine.scheduler.block_manager

    def generate() -> list[list[int]]:
        block_manager.reset_prefix_cache()  # every run computes every prompt: no hits left by the previous run
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    return generate, llm


SIDES = ("transformers", "transformers + reuse", "minivllm")
RUN_DEADLINE_S = 3600.0  # the longest a side may take to build, or to answer one timed run (--alone waits included)


def run_side(side: str, model_path: str, prompts: list[list[int]], max_tokens: int, alone: bool, conn) -> None:
    "One side in its own process: build and warm up (sending back its tokens), then one timed run per request."
    from minivllm.engine.host_memory import reuse_freed_memory

    if side == "transformers + reuse":
        reuse_freed_memory()
    llm = None
    if side == "minivllm":
        fn, llm = minivllm_generate(model_path, prompts, max_tokens)
    else:
        fn = transformers_generate(model_path, prompts, max_tokens)
    conn.send(fn())
    while conn.recv():
        if alone:
            conn.send(timed_alone(fn))
        else:
            start = time.perf_counter()
            fn()
            conn.send(time.perf_counter() - start)
    if llm is not None:
        llm.close()


def receive(conn, side: str, deadline_s: float = RUN_DEADLINE_S):
    if not conn.poll(deadline_s):
        raise TimeoutError(f"{side}: no answer within {deadline_s:.0f} s")
    return conn.recv()


def cpu_vs_transformers(
    num_prompts: int = 64,
    max_tokens: int = 64,
    seed: int = 0,
    repeats: int = 5,
    model_path: str | None = None,
    alone: bool = False,
) -> dict:
    "minivllm vs transformers `generate` on the same greedy batch on this CPU: median output tokens/s and their ratio."
    import multiprocessing as mp

    from transformers import AutoConfig

    from minivllm.tiny_model import TINY_MODEL_PATH

    model_path = str(model_path or TINY_MODEL_PATH)
    prompts = random_prompts(num_prompts, AutoConfig.from_pretrained(model_path).vocab_size, seed)
    ctx, conns, procs, tokens = mp.get_context("spawn"), {}, [], {}
    try:
        for side in SIDES:
            conns[side], child = ctx.Pipe()
            procs.append(ctx.Process(target=run_side, args=(side, model_path, prompts, max_tokens, alone, child)))
            procs[-1].start()
            tokens[side] = receive(conns[side], side)  # built and warmed up, one side at a time
        times = {side: [] for side in SIDES}
        for _ in range(repeats):  # interleaved: a busy moment hits every side
            for side in SIDES:
                conns[side].send(True)
                times[side].append(receive(conns[side], side))
        for side in SIDES:
            conns[side].send(False)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    num_tokens = num_prompts * max_tokens
    median = {side: statistics.median(times[side]) for side in SIDES}
    hf_tokens, mv_tokens = tokens["transformers"], tokens["minivllm"]
    return dict(
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        seed=seed,
        repeats=repeats,
        alone=alone,
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=num_tokens,
        threads=torch.get_num_threads(),
        times=times,
        seconds=median,
        tok_s={side: num_tokens / median[side] for side in SIDES},
        speedup=median["transformers"] / median["minivllm"],
        speedup_same_malloc=median["transformers + reuse"] / median["minivllm"],
        identical_outputs=sum(a == b for a, b in zip(hf_tokens, mv_tokens)),
        same_tokens_with_reuse=tokens["transformers + reuse"] == hf_tokens,
        all_lengths_ok=all(len(t) == max_tokens for t in hf_tokens + mv_tokens),
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--alone",
        action="store_true",
        help="keep only runs during which other processes used < 5%% of a core (a shared machine)",
    )
    args = parser.parse_args(argv)
    r = cpu_vs_transformers(args.num_prompts, args.max_tokens, args.seed, args.repeats, alone=args.alone)
    print(
        f"workload: {r['num_prompts']} prompts ({r['prompt_tokens']} tokens, lengths 32..256, seed {r['seed']}) "
        f"x {r['max_tokens']} greedy output tokens; {r['threads']} torch threads; median of {r['repeats']} runs"
        + (" with the machine to itself" if r["alone"] else "")
    )
    for side, label in zip(SIDES, ("transformers generate", "transformers + reuse", "minivllm LLM.generate")):
        print(
            f"{label:22} {r['tok_s'][side]:8.1f} output tok/s  ({r['seconds'][side]:.2f} s; runs "
            + ", ".join(f"{t:.2f}" for t in r["times"][side])
            + ")"
        )
    print(
        f"speedup: {r['speedup']:.2f}x transformers as it comes, {r['speedup_same_malloc']:.2f}x with the same "
        f"malloc setting   identical greedy outputs: {r['identical_outputs']}/{r['num_prompts']} (transformers + "
        f"reuse: the same tokens: {r['same_tokens_with_reuse']})   all outputs {r['max_tokens']} tokens: "
        f"{r['all_lengths_ok']}"
    )
    return r


if __name__ == "__main__":
    main()
