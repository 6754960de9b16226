"""Forced rejection for the speculation benchmarks (tools/spec_bench.py, tools/spec_smollm2.py): the n-gram proposer
padded to k guesses and every guess rejected, so a run measures the cost of trying.

    forced("forced_reject")         # k guesses whenever the engine asks; a request backs off after two misses
    forced("forced_reject_always")  # a verify step at every step (no backing off): the cost of one
    forced("plain")                 # the engine as it is
"""

import numpy as np
import torch

import minivllm.spec_decode.rejection as R
import minivllm.spec_decode.speculator as speculator
import minivllm.spec_decode.verify as V
from minivllm.spec_decode.ngram import NgramProposer

orig_propose, orig_accept, orig_greedy = NgramProposer.propose, R._accept, V.accept_greedy
BACKOFF_AFTER = speculator.BACKOFF_AFTER


def always_k(self, histories, max_k=None):  # the real lookup, padded to k guesses (the last token repeated)
    caps = [self.k] * len(histories) if max_k is None else [min(self.k, m) for m in max_k]
    return [(g + [int(h[-1])] * c)[:c] for g, h, c in zip(orig_propose(self, histories, max_k), histories, caps)]


def reject_all(*args):
    return torch.zeros_like(orig_accept(*args))


def reject_greedy(draft, counts, target):
    return orig_greedy(np.full_like(draft, -1), counts, target)


def forced(mode: str) -> None:
    "Patch (a `forced_reject` mode) or restore (any other) the proposer, the verifier and the back-off."
    on = mode.startswith("forced_reject")
    patched = (always_k, reject_all, reject_greedy) if on else (orig_propose, orig_accept, orig_greedy)
    NgramProposer.propose, R._accept, V.accept_greedy = patched
    speculator.BACKOFF_AFTER = 10**9 if mode == "forced_reject_always" else BACKOFF_AFTER
