"""Speculative decoding's pieces (notebooks/deep_dives/10_speculative_decoding.ipynb): vLLM's speculative_config
checked once, the n-gram proposer's choice of match, and a rejection sampler whose first emitted token follows the
target distribution exactly (chi-square at alpha 0.001) and whose mean acceptance matches the theory."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import NgramProposer, ngram_match, propose_ngram
from minivllm.spec_decode.rejection import rejection_sample

ALPHA = 0.001  # the goodness-of-fit tests' significance level


def test_config_parses_both_methods_with_vllm_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 2)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"model": "draft/path", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "draft/path", 3)


@pytest.mark.parametrize(
    "d, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model"),
        ({"num_speculative_tokens": 2}, "method must be one of ngram, draft_model, got None"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key(s) ['k']; allowed keys: method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1, got None"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "(3) must"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be an"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model applies to method 'draft_model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' needs model"),
        ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method 'ngram' only"),
    ],
)
def test_config_errors_name_the_field_and_what_it_allows(d, message):
    with pytest.raises(ValueError, match="speculative_config: ") as error:
        SpeculativeConfig.from_dict(d)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),  # k truncated by the end of the history
        ([1, 2, 3, 4], 1, 3, 4, []),  # nothing recurs
        ([7], 1, 1, 3, []),  # too short to recur
        ([1, 2, 9, 9, 1, 2], 2, 2, 2, [9, 9]),  # the match is at the very start
        ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2, [9, 1]),  # two earlier occurrences: the earliest wins (vLLM)
        ([3, 1, 2, 8, 4, 1, 2, 6, 4, 1, 2], 1, 3, 2, [6, 4]),  # the longest n wins over an earlier shorter match
        ([3, 1, 2, 8, 4, 1, 2, 6, 4, 1, 2], 1, 2, 2, [8, 4]),  # max_n = 2: the earliest [1, 2]
        ([4, 1, 2, 6, 9, 2], 2, 3, 2, []),  # only n = 1 recurs and min_n = 2
        ([4, 1, 2, 6, 9, 2], 1, 3, 2, [6, 9]),
        ([1, 1, 1, 1], 2, 2, 5, [1, 1]),  # an occurrence may overlap the suffix
    ],
)
def test_ngram_proposals_on_hand_made_histories(tokens, min_n, max_n, k, expected):
    assert propose_ngram(np.array(tokens), min_n, max_n, k).tolist() == expected


def test_ngram_matches_the_plain_definition_on_random_histories():
    rng = np.random.default_rng(0)
    for _ in range(500):
        t = rng.integers(0, 3, int(rng.integers(1, 30))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        want = (0, -1)
        for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
            starts = [s for s in range(len(t) - n) if t[s : s + n] == t[-n:]]
            if starts:
                want = (n, starts[0] + n)
                break
        assert ngram_match(np.array(t), min_n, max_n) == want, (t, min_n, max_n)


def test_ngram_proposer_batches_and_caps_each_sequence():
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    )
    histories = [np.array([1, 2, 3, 4, 5, 1, 2]), np.array([1, 2, 3]), np.array([9, 8, 7, 6, 9, 8])]
    assert NgramProposer(config).propose(histories) == [[3, 4, 5], [], [7, 6, 9]]
    assert NgramProposer(config).propose(histories, max_k=[1, 5, 0]) == [[3], [], []]
    with pytest.raises(ValueError, match="method 'ngram'"):
        NgramProposer(SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2}))


def one_hot_rows(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    rows = torch.full((len(argmaxes), vocab), 0.05)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1 - 0.05 * (vocab - 1)
    return rows


def test_greedy_keeps_the_longest_matching_prefix_then_the_target_token():
    target = one_hot_rows([1, 2, 3, 0, 4, 4, 2, 3, 1, 0])  # sequences of 3, 2, 0 and 2 guesses: 4 + 3 + 1 + 2 rows
    guesses = torch.tensor([1, 2, 4, 4, 4, 0, 0])
    out = rejection_sample(guesses, [3, 2, 0, 2], target, None, [True] * 4)
    assert out == [[1, 2, 3], [4, 4, 2], [3], [1]]
    draft_probs = torch.softmax(torch.randn(7, 5), 1)  # greedy ignores q
    assert rejection_sample(guesses, [3, 2, 0, 2], target, draft_probs, [True] * 4) == out
    assert rejection_sample(torch.tensor([], dtype=torch.long), [0, 0], target[:2], None, [True, True]) == [[1], [2]]


def sample_first_tokens(p: torch.Tensor, q: torch.Tensor | None, guesses: torch.Tensor, n: int) -> list[list[int]]:
    k = p.shape[0] - 1
    draft_probs = None if q is None else q.repeat(n, 1)
    return rejection_sample(guesses, [k] * n, p.repeat(n, 1), draft_probs, [False] * n)


def expected_and_sd_of_accepted(beta: torch.Tensor, n: int) -> tuple[float, float]:
    "E[accepted] = sum_j prod_{i<=j} beta_i, and the standard error of a mean of n (P(A >= j) = prod_{i<=j} beta_i)."
    tail = beta.double().cumprod(0)
    mean = tail.sum().item()
    second = sum((2 * j + 1) * t for j, t in enumerate(tail.tolist()))  # E[A^2] = sum_j (2j - 1) P(A >= j)
    return mean, math.sqrt((second - mean**2) / n)


@pytest.fixture
def target_and_draft() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(1.5 * torch.randn(4, 6, generator=g), 1)
    p[:, 5] = 0  # a token the target never says
    p /= p.sum(1, keepdim=True)
    q = torch.softmax(1.5 * torch.randn(3, 6, generator=g), 1)
    return p, q


@pytest.mark.parametrize("draft", ["draft_model", "ngram"])
def test_first_emitted_token_follows_the_target_and_acceptance_matches_theory(draft, target_and_draft):
    p, q = target_and_draft
    n, k = 20_000, 3
    torch.manual_seed(1)
    if draft == "ngram":
        q_used = None
        guesses = torch.tensor([2, 0, 1] * n)
        beta = p[torch.arange(k), torch.tensor([2, 0, 1])]
    else:
        q_used = q
        guesses = torch.multinomial(q, n, replacement=True).T.reshape(-1)
        beta = torch.minimum(p[:k], q).sum(1)
    out = sample_first_tokens(p, q_used, guesses, n)
    assert all(p[j, t] > 0 for tokens in out for j, t in enumerate(tokens))  # never a token of probability 0
    counts = np.bincount([tokens[0] for tokens in out], minlength=6)
    expected = p[0, :5].double().numpy() / p[0, :5].double().sum().item() * n
    assert chisquare(counts[:5], expected).pvalue > ALPHA
    mean, sd = expected_and_sd_of_accepted(beta, n)
    measured = np.mean([len(tokens) - 1 for tokens in out])
    assert abs(measured - mean) < 5 * sd, (measured, mean, sd)  # 5 standard errors


def test_the_fit_test_rejects_the_raw_draft(target_and_draft):
    "The same test has the power to see a wrong distribution: the draft's own first guesses fail it."
    p, q = target_and_draft
    torch.manual_seed(1)
    guesses = torch.multinomial(q[0], 20_000, replacement=True)
    counts = np.bincount(guesses.numpy(), minlength=6)
    expected = p[0, :5].double().numpy() / p[0, :5].double().sum().item() * counts[:5].sum()
    assert chisquare(counts[:5], expected).pvalue < ALPHA


def test_seeded_sequences_repeat_whatever_the_batch(target_and_draft):
    p, q = target_and_draft
    guesses = torch.multinomial(q, 50, replacement=True, generator=torch.Generator().manual_seed(3)).T.reshape(-1)

    def first_of(batch: int, seed: int) -> list[int]:
        gens = [torch.Generator().manual_seed(seed)] + [None] * (batch - 1)
        return rejection_sample(
            guesses[: 3 * batch], [3] * batch, p.repeat(batch, 1), q.repeat(batch, 1), [False] * batch, gens
        )[0]

    runs = {seed: first_of(1, seed) for seed in range(20)}
    assert all(first_of(50, seed) == runs[seed] for seed in (0, 7, 19))
    assert len({tuple(r) for r in runs.values()}) > 1  # the seed matters


def greedy_reference(guesses: list[int], rows: torch.Tensor) -> list[int]:
    "The plain rule: keep guesses while each is its row's argmax; then the argmax of the first row that disagrees."
    out = []
    for guess, row in zip(guesses, rows):
        if guess != row.argmax().item():
            break
        out.append(guess)
    return out + [rows[len(out)].argmax().item()]


def test_mixed_batch_of_greedy_and_sampled_rows_with_varying_k(target_and_draft):
    p, q = target_and_draft
    counts = [3, 0, 2, 1, 3]
    flat = [[p[0].argmax().item(), p[1].argmax().item(), (p[2].argmax().item() + 1) % 5], [], [3, 4], [4], [0, 1, 2]]
    rows = torch.cat([p[: c + 1] for c in counts])
    out = rejection_sample(
        torch.tensor(sum(flat, [])), counts, rows, torch.cat([q[:c] for c in counts]), [True, False, True, False, False]
    )
    assert out[0] == greedy_reference(flat[0], p) and len(out[0]) == 3  # two guesses kept, the third replaced
    assert out[2] == greedy_reference(flat[2], p)
    for tokens, c, guesses in zip(out, counts, flat):
        assert 1 <= len(tokens) <= c + 1 and tokens[:-1] == guesses[: len(tokens) - 1]
        assert all(p[j, t] > 0 for j, t in enumerate(tokens))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_cuda_tensors(target_and_draft):
    p, q = target_and_draft
    guesses = torch.tensor([0, 1, 2, 3, 4, 4])
    gens = [torch.Generator("cuda").manual_seed(0), None]
    out = rejection_sample(guesses.cuda(), [3, 3], p.repeat(2, 1).cuda(), q.repeat(2, 1).cuda(), [False, True], gens)
    assert out[1] == greedy_reference([3, 4, 4], p)
    assert all(p[j, t] > 0 for tokens in out for j, t in enumerate(tokens))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_steps_replay_cuda_graphs_with_the_tokens_of_eager_steps(monkeypatch):
    """On a GPU, verify steps replay the decode graphs (or, laid out as prompt chunks, the mixed graphs), and greedy
    outputs match eager speculation and plain decoding."""
    import minivllm.engine.batch_builder as bb
    from minivllm import LLM, TINY_DRAFT_PATH, TINY_MODEL_PATH, SamplingParams
    from minivllm.engine.cuda_graph import CUDAGraphRunner, MixedGraphRunner

    replays = {CUDAGraphRunner: [], MixedGraphRunner: []}
    for cls in replays:

        def counted(self, step, *args, cls=cls, replay=cls.replay):
            replays[cls].append(step.num_draft_tokens is not None)
            return replay(self, step, *args)

        monkeypatch.setattr(cls, "replay", counted)
    prompts = ["a b c a b c a b c a b c", "def f(x):\n    return x\n\ndef f(x):\n", "hello", [7, 8, 9, 7, 8, 9, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft = {"method": "draft_model", "model": TINY_DRAFT_PATH, "num_speculative_tokens": 3}
    runs = {}
    for name, spec, eager in [
        ("plain", None, False),
        ("ngram", ngram, False),
        ("eager", ngram, True),
        ("draft", draft, False),
        ("chunks", ngram, False),
    ]:
        if name == "chunks":  # every verify step laid out as prompt chunks
            monkeypatch.setattr(bb, "VERIFY_DECODE_MAX_ROWS", 0)
        with LLM(
            TINY_MODEL_PATH,
            device="cuda",
            dtype="float32",
            speculative_config=spec,
            enforce_eager=eager,
            gpu_memory_utilization=0.3,
        ) as llm:
            runs[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
            if spec is not None:
                assert llm.llm_engine.stats.num_spec_accepted_tokens > 0
    assert all(runs[name] == runs["plain"] for name in ("ngram", "eager", "draft", "chunks"))
    assert any(replays[CUDAGraphRunner]) and any(replays[MixedGraphRunner])  # (verify steps among the replays)


def test_greedy_verification_on_the_host_matches_rejection_sampling():
    "accept_greedy (the all-greedy fast path: one argmax copied to the host) emits what rejection_sample emits."
    from minivllm.spec_decode.rejection import accept_greedy

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        counts = torch.randint(0, 5, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        logits = torch.randn(sum(counts) + len(counts), 6, generator=gen)
        argmax = logits.argmax(-1)
        rows = [r for i, k in enumerate(counts) for r in range(sum(counts[:i]) + i, sum(counts[:i]) + i + k)]
        guesses = torch.where(
            torch.rand(len(rows), generator=gen) < 0.7, argmax[rows], torch.randint(0, 6, (len(rows),), generator=gen)
        )
        probs = torch.zeros_like(logits).scatter_(1, argmax[:, None], 1.0)
        expected = rejection_sample(guesses, counts, probs, None, [True] * len(counts))
        assert accept_greedy(guesses.numpy(), counts, argmax.numpy()) == expected


def test_verify_inputs_are_a_decode_step_of_the_prompt_chunk_tokens():
    """prepare_verify (decodes verifying guesses, no loop over sequences) lays out prepare_step's tokens as a decode
    step: one row per token, its context up to its own position, its sequence's block table; or, for large steps,
    exactly as prepare_step does."""
    from minivllm.engine.batch_builder import BlockTables, prepare_step, prepare_verify
    from minivllm.engine.scheduler import StepPlan
    from minivllm.engine.sequence import Sequence
    from minivllm.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    for batch in (1, 3, 17):
        seqs, guesses = [], []
        for _ in range(batch):
            seq = Sequence(rng.integers(0, 50, int(rng.integers(1, 40))).tolist(), SamplingParams(max_tokens=64))
            for token in rng.integers(0, 50, int(rng.integers(1, 5))):
                seq.append_token(int(token))
            seq.num_computed_tokens = seq.num_tokens - 1
            seq.block_table = rng.permutation(400)[:12].tolist()  # 48 positions in blocks of 4
            seqs.append(seq)
            guesses.append(rng.integers(0, 50, int(rng.integers(0, 4))).tolist())
        plan = StepPlan.of(seqs, [1 + len(g) for g in guesses], [], spec_token_ids=guesses)
        assert not plan.num_prefill_tokens
        expected, got = prepare_step(plan, 4), prepare_verify(plan, 4, BlockTables(12, batch))
        fields = ("input_ids", "positions", "slot_mapping", "logits_indices", "seq_ids", "draft_token_ids")
        for name in fields:
            assert np.array_equal(getattr(got, name), getattr(expected, name)), name
        rows = np.repeat(np.arange(batch), np.diff(expected.cu_seqlens_q))  # each token's sequence
        assert np.array_equal(got.context_lens, got.positions + 1)
        assert np.array_equal(got.cu_seqlens_q, np.arange(len(rows) + 1))
        assert np.array_equal(got.cu_seqlens_k, np.concatenate([[0], np.cumsum(got.context_lens)]))
        assert np.array_equal(got.block_tables[:, :12], expected.block_tables[rows, :12])
        assert got.is_decode_only and got.max_seqlen_k == expected.max_seqlen_k
        assert got.num_draft_tokens == expected.num_draft_tokens
        chunks = prepare_verify(plan, 4, BlockTables(12, batch), as_decode=False)  # as prepare_step lays them out
        for name in (*fields, "cu_seqlens_q", "cu_seqlens_k", "context_lens"):
            assert np.array_equal(getattr(chunks, name), getattr(expected, name)), name
        assert np.array_equal(chunks.block_tables[:, :12], expected.block_tables[:, :12])
        assert (chunks.max_seqlen_q, chunks.max_seqlen_k) == (expected.max_seqlen_q, expected.max_seqlen_k)
