"""Tests of minivllm.layers.sampler (greedy, temperature, top-k, top-p, min-p, logprobs) and of the seeds that
minivllm.engine.sampling_cache.SamplingRegistry keeps (a seeded request's own generator, the engine's for the others).

References: the argmax of the raw logits; Hugging Face `transformers`' logits warpers (chained in `generate`'s
order: temperature, top-k, top-p, min-p); a plain-Python float64 implementation of the same rules; chi-square tests of
sampled frequencies at fixed seeds; `torch.log_softmax`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minivllm import LLM, TINY_MODEL_PATH
from minivllm.engine.sampling_cache import SamplingRegistry
from minivllm.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingTensors,
    apply_min_p,
    apply_top_k,
    apply_top_k_top_p,
    filtered_logits,
    gather_logprobs,
    random_sample,
)
from minivllm.sampling_params import SamplingParams

# The running example of notebook 06: 12 candidate tokens after "def fibonacci(n):\n    ".
EXAMPLE = [3.2, 2.9, 2.1, 1.7, 1.4, 1.0, 0.6, 0.3, 0.0, -0.4, -0.9, -1.5]
sampler = Sampler()


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- references


def hf_filtered(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    "One row through transformers' warpers, in generate's order: temperature, top-k, top-p, min-p."
    scores, ids = row.float().unsqueeze(0), torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(float(sp.temperature))]
    if sp.top_k > 0:
        warpers.append(TopKLogitsWarper(sp.top_k))
    if sp.top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(sp.top_p)))
    if sp.min_p > 0.0:
        warpers.append(MinPLogitsWarper(float(sp.min_p)))
    for w in warpers:
        scores = w(ids, scores)
    return scores[0]


def our_filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    "The Sampler's pipeline up to the softmax, batched (the package's own `filtered_logits`)."
    return filtered_logits(logits, SamplingTensors.from_params(params, logits.device))


def reference_probs(logits: list[float], T: float = 1.0, k: int = 0, p: float = 1.0, m: float = 0.0) -> list[float]:
    "The filtered, renormalized distribution, in plain float64 Python, straight from the definitions."
    z = [x / T for x in logits]
    keep = set(range(len(z)))
    by_logit = sorted(keep, key=lambda i: -z[i])
    if k > 0:
        kth = z[by_logit[min(k, len(z)) - 1]]
        keep = {i for i in keep if z[i] >= kth}

    def normalized(kept):
        top = max(z[i] for i in kept)
        w = {i: math.exp(z[i] - top) for i in kept}
        total = sum(w.values())
        return {i: w[i] / total for i in kept}

    probs = normalized(keep)
    if p < 1.0:
        before, nucleus = 0.0, set()
        for i in sorted(keep, key=lambda i: -probs[i]):
            if before < p:  # keep a token while the more likely ones hold less than p
                nucleus.add(i)
            before += probs[i]
        probs = normalized(nucleus)
    if m > 0.0:
        best = max(probs.values())
        probs = normalized({i for i in probs if probs[i] >= m * best})
    return [probs.get(i, 0.0) for i in range(len(z))]


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_of_raw_logits_exactly():
    logits = random_logits(16, 1000, seed=0)
    s = SamplingTensors.from_params([SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.5)] * 16)
    assert s.all_greedy and s.temperatures is None and s.top_p is None
    assert torch.equal(sampler(logits, s), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_in_low_precision_matches_float32_argmax(dtype):
    logits = random_logits(8, 500, seed=1).to(dtype)
    s = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(sampler(logits, s), logits.float().argmax(dim=-1))
    # and in a mixed batch, where the random rows go through float32
    mixed = SamplingTensors.from_params([SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)] * 4)
    ids = sampler(logits, mixed)
    assert torch.equal(ids[0::2], logits.float().argmax(dim=-1)[0::2])


def test_greedy_rows_of_a_mixed_batch_take_the_argmax():
    logits = random_logits(6, 300, seed=2)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(top_k=7, min_p=0.1),
        SamplingParams(temperature=1e-6),
        SamplingParams(top_p=0.3),
    ]
    s = SamplingTensors.from_params(params)
    assert not s.all_greedy and not s.all_random
    assert s.greedy_mask.tolist() == [True, False, True, False, True, False]
    torch.manual_seed(0)
    for _ in range(20):
        ids = sampler(logits, s)
        assert torch.equal(ids[[0, 2, 4]], logits[[0, 2, 4]].argmax(dim=-1))


def test_sampler_leaves_the_callers_logits_untouched():
    logits = random_logits(4, 200, seed=3)
    before = logits.clone()
    s = SamplingTensors.from_params(
        [
            SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.1),
            SamplingParams(temperature=0.5),
            SamplingParams(temperature=0.0),
            SamplingParams(top_k=3),
        ]
    )
    sampler(logits, s)
    assert torch.equal(logits, before)
    s = SamplingTensors.from_params([SamplingParams(top_k=3)] * 4)  # the topk-only path
    sampler(logits, s)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- SamplingTensors


def test_sampling_tensors_flags_and_neutral_values():
    params = [
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.3),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=3, logprobs=2),
        SamplingParams(top_k=-1, logprobs=0),
    ]
    s = SamplingTensors.from_params(params)
    assert s.batch_size == 4 and not s.all_greedy and not s.all_random
    assert s.temperatures.tolist() == pytest.approx([1.0, 0.7, 1.0, 1.0])
    assert s.top_k.tolist() == [0, 0, 3, 0] and s.max_top_k == 3
    assert s.top_p is None and s.min_p is None  # only the greedy row asked for them: nobody needs them
    assert s.num_logprobs == [None, None, 2, 0] and s.max_num_logprobs == 2
    s = SamplingTensors.from_params([SamplingParams(top_p=0.9), SamplingParams(min_p=0.05)])
    assert s.all_random and s.greedy_mask is None and s.top_k is None and s.max_top_k == 0
    assert s.top_p.tolist() == pytest.approx([0.9, 1.0]) and s.min_p.tolist() == pytest.approx([0.0, 0.05])
    assert s.max_num_logprobs is None
    assert s.temperatures.dtype == torch.float32 and s.top_p.dtype == torch.float32


# ---------------------------------------------------------------- filters against transformers

FILTER_PARAMS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=10),
    SamplingParams(top_k=400),
    SamplingParams(top_k=5000),
    SamplingParams(top_p=0.01),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.999),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.5),
    SamplingParams(min_p=1.0),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.8),
    SamplingParams(temperature=1.7, top_k=50, min_p=0.02),
    SamplingParams(temperature=0.8, top_p=0.95, min_p=0.1),
    SamplingParams(temperature=1.3, top_k=30, top_p=0.7, min_p=0.05),
    SamplingParams(temperature=0.9),
    SamplingParams(),
]


def assert_same_filter(ours: torch.Tensor, theirs: torch.Tensor):
    kept, hf_kept = torch.isfinite(ours), torch.isfinite(theirs)
    assert torch.equal(kept, hf_kept), f"kept {kept.sum()} tokens, transformers {hf_kept.sum()}"
    if ours.is_cuda:  # a GPU may divide by a tensor and by a Python float one ulp apart
        torch.testing.assert_close(ours[kept], theirs[hf_kept], rtol=1e-6, atol=0)
    else:
        assert torch.equal(ours[kept], theirs[hf_kept])


def test_each_filter_matches_transformers_warpers_in_one_mixed_batch():
    logits = random_logits(len(FILTER_PARAMS), 500, seed=4)
    ours = our_filtered(logits, FILTER_PARAMS)
    for row, sp in enumerate(FILTER_PARAMS):
        assert_same_filter(ours[row], hf_filtered(logits[row], sp))


@pytest.mark.parametrize("sp", FILTER_PARAMS, ids=lambda sp: f"T{sp.temperature}-k{sp.top_k}-p{sp.top_p}-m{sp.min_p}")
def test_each_filter_matches_transformers_warpers_alone(sp):
    "The same rows, each in a batch of its own kind (the paths that skip filters nobody asked for)."
    logits = random_logits(3, 500, seed=5)
    ours = our_filtered(logits, [sp] * 3)
    for row in range(3):
        assert_same_filter(ours[row], hf_filtered(logits[row], sp))


def test_top_k_keeps_ties_like_transformers():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, -1.0], [5.0, 4.0, 4.0, 3.0, 3.0, 3.0]])
    k = torch.tensor([2, 4])
    expected = torch.stack([TopKLogitsWarper(int(kk))(None, logits[i : i + 1])[0] for i, kk in enumerate(k)])
    assert torch.equal(apply_top_k(logits.clone(), k, max_top_k=4), expected)
    assert torch.equal(apply_top_k_top_p(logits.clone(), k, None), expected)
    assert torch.isfinite(expected).sum(dim=1).tolist() == [3, 6]


def test_top_k_off_and_larger_than_the_vocabulary():
    logits = random_logits(3, 50, seed=6)
    k = torch.tensor([0, 50, 10_000])
    for out in (apply_top_k(logits.clone(), k, max_top_k=10_000), apply_top_k_top_p(logits.clone(), k, None)):
        assert torch.equal(out, logits)


def test_top_p_is_never_empty():
    logits = random_logits(5, 1000, seed=7, scale=0.01)  # nearly flat: no token alone reaches p
    p = torch.tensor([1e-9, 1e-4, 5e-4, 1e-6, 1e-9])  # each token holds ~1e-3
    k = torch.tensor([0, 0, 0, 3, 1])
    out = apply_top_k_top_p(logits.clone(), k, p)
    assert torch.isfinite(out).sum(dim=1).tolist() == [1] * 5
    assert torch.equal(out.argmax(dim=1), logits.argmax(dim=1))
    # all of a row's mass on one token: still exactly that token, for any p
    peaked = torch.full((2, 10), -1e4)
    peaked[:, 3] = 0.0
    out = apply_top_k_top_p(peaked.clone(), None, torch.tensor([0.5, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [i == 3 for i in range(10)]


def test_top_p_one_and_min_p_zero_keep_everything():
    logits = random_logits(2, 300, seed=8)
    assert torch.equal(apply_top_k_top_p(logits.clone(), None, torch.ones(2)), logits)
    assert torch.equal(apply_min_p(logits.clone(), torch.zeros(2)), logits)


def test_running_example_worked_numbers():
    "The numbers worked out in notebook 06."
    row = torch.tensor([EXAMPLE])
    kept = lambda x: torch.isfinite(x[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(apply_top_k_top_p(row.clone(), None, torch.tensor([0.9]))) == [0, 1, 2, 3, 4, 5]
    assert kept(apply_min_p(row.clone(), torch.tensor([0.2]))) == [0, 1, 2, 3]
    assert kept(apply_top_k(row.clone(), torch.tensor([3]), 3)) == [0, 1, 2]
    chained = apply_min_p(apply_top_k_top_p(row / 0.7, torch.tensor([5]), torch.tensor([0.95])), torch.tensor([0.15]))
    assert kept(chained) == [0, 1, 2]
    v1_order = apply_top_k_top_p(apply_min_p(row.clone(), torch.tensor([0.2])), None, torch.tensor([0.9]))
    assert kept(v1_order) == [0, 1, 2]  # min-p before top-p (vLLM V1's order) drops "a" as well


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.sampled_from([-1, 0, 1, 2, 7, 40, 100]),
    top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.01, 0.2, 0.9]),
)
def test_sampled_tokens_are_always_ones_transformers_keeps(seed, temperature, top_k, top_p, min_p):
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    other = SamplingParams(temperature=0.8, top_k=5)
    logits = random_logits(3, 64, seed=seed)
    torch.manual_seed(seed)
    ids = sampler(logits, SamplingTensors.from_params([sp, other, sp]))
    for row in (0, 2):
        if sp.greedy:
            assert ids[row] == logits[row].argmax()
        else:
            assert torch.isfinite(hf_filtered(logits[row], sp)[ids[row]])
    assert torch.isfinite(hf_filtered(logits[1], other)[ids[1]])


# ---------------------------------------------------------------- sampling frequencies (chi-square, fixed seeds)

COMBOS = {  # name -> (SamplingParams, the reference's arguments)
    "T=1": (SamplingParams(), {}),
    "T=0.7": (SamplingParams(temperature=0.7), dict(T=0.7)),
    "T=1.5": (SamplingParams(temperature=1.5), dict(T=1.5)),
    "k=3": (SamplingParams(top_k=3), dict(k=3)),
    "m=0.2": (SamplingParams(min_p=0.2), dict(m=0.2)),
    "T=1.3,k=6,m=0.1": (SamplingParams(temperature=1.3, top_k=6, min_p=0.1), dict(T=1.3, k=6, m=0.1)),
    "p=0.9": (SamplingParams(top_p=0.9), dict(p=0.9)),
    "k=5,p=0.8": (SamplingParams(top_k=5, top_p=0.8), dict(k=5, p=0.8)),
    "T=0.7,k=5,p=0.95,m=0.15": (
        SamplingParams(temperature=0.7, top_k=5, top_p=0.95, min_p=0.15),
        dict(T=0.7, k=5, p=0.95, m=0.15),
    ),
    "T=2,p=0.8,m=0.05": (SamplingParams(temperature=2.0, top_p=0.8, min_p=0.05), dict(T=2.0, p=0.8, m=0.05)),
    "p=0.9,m=0.2": (SamplingParams(top_p=0.9, min_p=0.2), dict(p=0.9, m=0.2)),  # min-p first would never draw "a"
}
N_DRAWS = 20_000


def assert_frequencies(ids: torch.Tensor, expected: list[float], name: str):
    counts = torch.bincount(ids, minlength=len(expected)).tolist()
    kept = [i for i, q in enumerate(expected) if q > 0]
    assert all(counts[i] == 0 for i in range(len(expected)) if expected[i] == 0), f"{name}: a filtered token drawn"
    n = sum(counts)
    result = chisquare([counts[i] for i in kept], [n * expected[i] for i in kept])
    assert result.pvalue > 1e-3, f"{name}: counts {counts} vs expected {[round(n * q) for q in expected]}"


@pytest.mark.parametrize(
    "names",
    [
        ["T=1", "T=0.7", "T=1.5", "k=3", "m=0.2", "T=1.3,k=6,m=0.1"],  # no top-p: top-k by topk, no sort
        ["p=0.9", "k=5,p=0.8", "T=0.7,k=5,p=0.95,m=0.15", "T=2,p=0.8,m=0.05", "p=0.9,m=0.2", "k=3", "T=1"],  # one sort
    ],
    ids=["topk-path", "sort-path"],
)
def test_frequencies_match_the_filtered_distribution(names):
    "One mixed batch holds N_DRAWS rows of each combination (and greedy rows): each group's draws follow its law."
    params = [sp for name in names for sp in [COMBOS[name][0]] * N_DRAWS] + [SamplingParams(temperature=0.0)] * 10
    logits = torch.tensor([EXAMPLE]).repeat(len(params), 1)
    torch.manual_seed(1234)
    ids = sampler(logits, SamplingTensors.from_params(params))
    for g, name in enumerate(names):
        expected = reference_probs(EXAMPLE, **COMBOS[name][1])
        assert_frequencies(ids[g * N_DRAWS : (g + 1) * N_DRAWS], expected, name)
    assert (ids[-10:] == 0).all()


def test_reference_keeps_the_same_tokens_as_transformers():
    "The float64 reference and transformers agree on what each combination keeps (so the chi-square tests the law)."
    for name, (sp, kw) in COMBOS.items():
        ref = torch.tensor(reference_probs(EXAMPLE, **kw)) > 0
        assert torch.equal(ref, torch.isfinite(hf_filtered(torch.tensor(EXAMPLE), sp))), name


def test_random_sample_is_unbiased_and_ignores_zero_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(30_000, 1) * 7.0  # unnormalized is fine
    torch.manual_seed(99)
    ids = random_sample(probs.clone())
    assert_frequencies(ids, [0.5, 0.0, 0.3, 0.2, 0.0], "random_sample")


def test_a_seeded_request_samples_the_right_distribution_over_steps():
    "One request, one generator, 3000 steps: its draws follow the filtered law (the generator path is unbiased too)."
    sp = SamplingParams(temperature=0.7, top_p=0.95, seed=2024)
    cache = SamplingRegistry(torch.device("cpu"), seed=0)
    cache.add(0, sp)
    s, gens = cache.batch(np.array([0]))
    row = torch.tensor([EXAMPLE])
    ids = torch.cat([sampler(row, s, gens, cache.generator) for _ in range(3000)])
    assert_frequencies(ids, reference_probs(EXAMPLE, T=0.7, p=0.95), "seeded steps")


# ---------------------------------------------------------------- seeds

CPU = torch.device("cpu")


def sampling_cache(seq_ids, params: list[SamplingParams], seed: int = 0) -> SamplingRegistry:
    "A SamplingRegistry (its own generator seeded with `seed`) that knows the requests `seq_ids`."
    cache = SamplingRegistry(CPU, seed)
    for seq_id, sp in zip(seq_ids, params):
        cache.add(int(seq_id), sp)
    return cache


def seeded_run(
    layout: list[SamplingParams],
    seeded_row: int,
    steps: list[torch.Tensor],
    default_seed: int,
    seq_ids: list[int] | None = None,
) -> list[int]:
    """Sample each step's logits (the seeded request's row given, the others random); return the seeded row's tokens.
    The rows without a seed draw from the cache's own generator, seeded with `default_seed` (the engine's seed)."""
    seq_ids = np.array(seq_ids or range(100, 100 + len(layout)))
    cache = sampling_cache(seq_ids, layout, seed=default_seed)
    out = []
    for t, row_logits in enumerate(steps):
        logits = random_logits(len(layout), row_logits.shape[-1], seed=default_seed * 1000 + t)
        logits[seeded_row] = row_logits
        s, gens = cache.batch(seq_ids)
        out.append(int(sampler(logits, s, gens, cache.generator)[seeded_row]))
    return out


def test_seed_gives_the_same_tokens_in_any_batch_at_any_row():
    req = SamplingParams(temperature=1.0, seed=77)  # no filters of its own
    steps = [random_logits(1, 2000, seed=500 + t, scale=1.0)[0] for t in range(12)]
    g, r = SamplingParams(temperature=0.0), SamplingParams(temperature=1.2)
    layouts = [
        ([req], 0),  # alone: temperature only
        ([r, SamplingParams(top_p=0.9), req, SamplingParams(seed=5, top_k=4)], 2),  # the sort path
        ([SamplingParams(top_k=3), r, SamplingParams(min_p=0.1), r, r, req], 5),  # topk path + min-p
        ([g, g, req, g], 2),  # mixed greedy/random
        ([req, SamplingParams(seed=1), SamplingParams(seed=77, temperature=0.5)], 0),  # every row seeded
    ]
    runs = [seeded_run(layout, row, steps, default_seed=i) for i, (layout, row) in enumerate(layouts)]
    assert all(run == runs[0] for run in runs), runs
    assert len(set(runs[0])) > 3  # really random: many different tokens over 12 steps
    # a different seed gives different tokens; no seed follows the cache's own generator (the engine's seed)
    other = SamplingParams(temperature=1.0, seed=78)
    assert seeded_run([other], 0, steps, default_seed=0) != runs[0]
    unseeded = SamplingParams(temperature=1.0)
    assert seeded_run([unseeded], 0, steps, default_seed=0) != seeded_run([unseeded], 0, steps, default_seed=1)


def test_rows_without_a_seed_follow_the_engine_seed_not_torchs_global_rng():
    steps = [random_logits(1, 2000, seed=700 + t, scale=1.0)[0] for t in range(12)]
    layout = [SamplingParams(temperature=1.0), SamplingParams(top_p=0.9), SamplingParams(temperature=0.0)]
    torch.manual_seed(1)
    first = seeded_run(layout, 0, steps, default_seed=3)
    torch.manual_seed(123)  # torch's global generator plays no part
    assert seeded_run(layout, 0, steps, default_seed=3) == first
    assert len(set(first)) > 3
    # a request's seed is its own: the cache's generator draws only for the rows without one
    cache = sampling_cache([0, 1], [SamplingParams(seed=9), SamplingParams(seed=10)], seed=4)
    state = cache.generator.get_state()
    s, gens = cache.batch(np.array([0, 1]))
    sampler(random_logits(2, 100, seed=0), s, gens, cache.generator)
    assert torch.equal(cache.generator.get_state(), state)


def test_seeded_request_with_filters_is_reproducible():
    req = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=3)
    steps = [random_logits(1, 700, seed=900 + t, scale=2.0)[0] for t in range(10)]
    a = seeded_run([req], 0, steps, default_seed=10)
    b = seeded_run(
        [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(min_p=0.3), req], 3, steps, default_seed=11
    )
    assert a == b


def test_sampling_cache_lifecycle():
    params = [SamplingParams(seed=1), SamplingParams(), SamplingParams(temperature=0.0, seed=2), SamplingParams(seed=3)]
    cache = sampling_cache([10, 11, 12, 13], params)
    s, rows = cache.batch(np.array([10, 11, 12, 13]))
    assert s.batch_size == 4 and s.greedy_mask.tolist() == [False, False, True, False]
    assert sorted(rows) == [0, 3] and len(cache.generators) == 2  # greedy: no generator
    assert 10 in cache.generators and 12 not in cache.generators
    s, again = cache.batch(np.array([13, 10]))
    assert s.batch_size == 2 and s.all_random
    assert again[0] is rows[3] and again[1] is rows[0]  # kept across steps, whatever the row
    assert cache.batch(np.array([11, 12]))[1] is None  # no row with a seed
    assert all(g is not cache.generator for g in rows.values())
    cache.free(10)
    cache.free(999)  # unknown ids are ignored
    assert len(cache.generators) == 1 and 10 not in cache.generators and 10 not in cache.params
    assert sorted(cache.params) == [11, 12, 13]
    s, rows = cache.batch(np.array([13, 11]))
    assert s.batch_size == 2 and list(rows) == [0]


def test_sampling_cache_tensors_follow_the_batch():
    "The same requests give the same tensors; a batch of other requests (or another order) gets its own."
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(top_p=0.8), SamplingParams(temperature=0.0)]
    cache = sampling_cache([0, 1, 2], params)
    for ids in ([0, 1, 2], [2, 0], [1], [0, 1, 2]):
        s, _ = cache.batch(np.array(ids))
        ref = SamplingTensors.from_params([params[i] for i in ids])
        assert s.batch_size == ref.batch_size and s.all_greedy == ref.all_greedy
        for name in ("temperatures", "greedy_mask", "top_k", "top_p", "min_p"):
            a, b = getattr(s, name), getattr(ref, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (ids, name)


def test_generator_state_advances_between_steps():
    sp = SamplingParams(seed=0)
    cache = sampling_cache([0], [sp])
    flat = torch.zeros(1, 1000)  # uniform: every step's token is just the noise's argmin
    ids = [int(sampler(flat, *cache.batch(np.array([0])), cache.generator)) for _ in range(5)]
    assert len(set(ids)) == 5
    # and so does the engine's own generator, for a request without a seed
    cache = sampling_cache([0], [SamplingParams()])
    ids = [int(sampler(flat, *cache.batch(np.array([0])), cache.generator)) for _ in range(5)]
    assert len(set(ids)) == 5


ENGINE_PROMPTS = ["def fibonacci(n):\n    ", [5, 6, 7, 8], "import os\n", [9, 10, 11]]


def engine_random_outputs(seed: int, params: list[SamplingParams], prompts=ENGINE_PROMPTS) -> list[list[int]]:
    "The token ids an engine (tiny model, CPU, float32) with `Config.seed=seed` generates for `prompts`."
    with LLM(TINY_MODEL_PATH, device="cpu", dtype="float32", max_model_len=64, num_kvcache_blocks=32, seed=seed) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_random_outputs_depend_on_its_seed_only():
    """Temperature 1.0 without a seed: two engines with the same Config.seed give the same tokens, whatever torch's
    global RNG did in between; another seed gives other tokens. A request with its own seed gives the same tokens
    whatever its neighbours in the batch."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    torch.manual_seed(0)
    first = engine_random_outputs(0, params)
    torch.manual_seed(123)
    assert engine_random_outputs(0, params) == first
    assert len({t for ids in first for t in ids}) > 10  # really random
    assert engine_random_outputs(1, params) != first
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=42)
    alone = engine_random_outputs(0, [seeded], ENGINE_PROMPTS[:1])
    among = engine_random_outputs(
        5, [params, params, seeded, params], ENGINE_PROMPTS[1:3] + ENGINE_PROMPTS[:1] + ENGINE_PROMPTS[3:]
    )
    assert among[2] == alone[0]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_the_raw_log_softmax():
    logits = random_logits(4, 300, seed=11)
    params = [
        SamplingParams(temperature=0.5, logprobs=3),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    s = SamplingTensors.from_params(params)
    torch.manual_seed(0)
    ids = sampler(logits, s)
    assert s.max_num_logprobs == 5
    lt = gather_logprobs(logits, ids, s.max_num_logprobs)
    assert isinstance(lt, LogprobsTensors) and lt.token_ids.shape == lt.logprobs.shape == (4, 6)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(lt.token_ids[:, 0], ids)
    torch.testing.assert_close(lt.logprobs.double(), ref.gather(1, lt.token_ids), rtol=0, atol=1e-5)
    top = ref.topk(5, dim=-1)
    assert torch.equal(lt.token_ids[:, 1:], top.indices)
    per_row = lt.tolists(s.num_logprobs)
    assert per_row[2] is None
    assert list(per_row[1]) == [int(ids[1])]  # logprobs=0: only the sampled token
    for row, n in [(0, 3), (3, 5)]:
        d = per_row[row]
        assert next(iter(d)) == int(ids[row])  # the sampled token first
        assert set(d) == {int(ids[row])} | set(top.indices[row, :n].tolist())
        for tok, (lp, rank) in d.items():
            assert lp == pytest.approx(float(ref[row, tok]), abs=1e-5)
            assert rank == 1 + int((ref[row] > ref[row, tok]).sum())  # vLLM's rank: 1 for the most likely token
    assert len(per_row[3]) == 5  # greedy: the sampled token is the most likely one, so no extra entry


def test_logprobs_of_low_precision_logits_and_large_n():
    logits = random_logits(2, 8, seed=12).to(torch.bfloat16)
    ids = torch.tensor([3, 7])
    lt = gather_logprobs(logits, ids, 100)  # more than the vocabulary: all of it
    assert lt.logprobs.dtype == torch.float32 and lt.token_ids.shape == (2, 9)
    d = lt.tolists([100, 2])
    assert len(d[0]) == 8 and len(d[1]) in (2, 3)
    assert sum(math.exp(lp) for lp, _ in d[0].values()) == pytest.approx(1.0, abs=1e-5)
    assert sorted(rank for _, rank in d[0].values()) == list(range(1, 9))


def test_cumulative_logprob_as_the_engine_adds_it():
    logits_steps = [random_logits(1, 50, seed=20 + t) for t in range(6)]
    sp = SamplingParams(logprobs=1, seed=4)
    cache = sampling_cache([0], [sp])
    cumulative, expected = 0.0, 0.0
    for logits in logits_steps:
        s, gens = cache.batch(np.array([0]))
        ids = sampler(logits, s, gens, cache.generator)
        d = gather_logprobs(logits, ids, s.max_num_logprobs).tolists(s.num_logprobs)[0]
        cumulative += d[int(ids[0])][0]
        expected += float(torch.log_softmax(logits.double(), -1)[0, ids[0]])
    assert cumulative == pytest.approx(expected, abs=1e-4)


# ---------------------------------------------------------------- GPU (run by the lead on the H200)


@pytest.mark.gpu
def test_cuda_sampler_end_to_end():
    dev = torch.device("cuda")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.9, seed=7),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.95, min_p=0.15, logprobs=2),
    ]
    s = SamplingTensors.from_params(params, device=dev)  # the pinned, non-blocking copies
    assert s.temperatures.device.type == "cuda" and s.top_k.tolist() == [0, 3, 0, 5]
    logits = random_logits(4, 151_936, seed=0).to(dev, torch.bfloat16)
    cache = SamplingRegistry(dev, seed=0)
    for seq_id, sp in enumerate(params):
        cache.add(seq_id, sp)
    gens = cache.batch(np.arange(4))[1]
    assert list(gens) == [2] and gens[2].device.type == "cuda"
    ids = sampler(logits, s, gens, cache.generator)
    assert ids.device.type == "cuda" and ids[0] == logits[0].float().argmax()
    lt = gather_logprobs(logits, ids, s.max_num_logprobs)
    ref = torch.log_softmax(logits.float(), -1).gather(1, ids.unsqueeze(1))
    torch.testing.assert_close(lt.logprobs[:, :1], ref)
    # each filter on the GPU matches transformers' warpers on the GPU
    x = random_logits(len(FILTER_PARAMS), 5000, seed=1).to(dev)
    ours = our_filtered(x, FILTER_PARAMS)
    for row, sp in enumerate(FILTER_PARAMS):
        assert_same_filter(ours[row], hf_filtered(x[row], sp))


@pytest.mark.gpu
def test_cuda_frequencies_and_seeds():
    dev = torch.device("cuda")
    names = ["p=0.9", "k=5,p=0.8", "T=0.7,k=5,p=0.95,m=0.15", "k=3", "m=0.2"]
    params = [sp for name in names for sp in [COMBOS[name][0]] * N_DRAWS]
    logits = torch.tensor([EXAMPLE], device=dev).repeat(len(params), 1)
    torch.manual_seed(1234)
    ids = sampler(logits, SamplingTensors.from_params(params, device=dev)).cpu()
    for g, name in enumerate(names):
        assert_frequencies(ids[g * N_DRAWS : (g + 1) * N_DRAWS], reference_probs(EXAMPLE, **COMBOS[name][1]), name)
    req = SamplingParams(temperature=1.0, seed=77)
    steps = [random_logits(1, 151_936, seed=t)[0].to(dev) for t in range(8)]
    runs = []
    for layout, row in [([req], 0), ([SamplingParams(top_p=0.9), SamplingParams(), req], 2)]:
        cache = SamplingRegistry(dev, seed=len(runs))
        for seq_id, sp in enumerate(layout):
            cache.add(seq_id, sp)
        out = []
        for step in steps:
            x = torch.randn(len(layout), step.shape[-1], device=dev)
            x[row] = step
            s, gens = cache.batch(np.arange(len(layout)))
            out.append(int(sampler(x, s, gens, cache.generator)[row]))
        runs.append(out)
    assert runs[0] == runs[1]
