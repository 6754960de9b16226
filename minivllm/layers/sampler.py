from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..sampling_params import SamplingParams

_NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    "Keep each row's logits >= its `k`-th largest (`k <= 0`: all), in place; `max_top_k` = max(k): no sort, no sync."
    max_top_k = min(max_top_k, logits.shape[-1])
    if max_top_k < 1:
        return logits
    kth_largest = logits.topk(max_top_k, dim=-1).values.gather(1, (k.clamp(1, max_top_k) - 1).unsqueeze(1))
    kth_largest.masked_fill_((k <= 0).unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth_largest, _NEG_INF)

# %%
def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    "Top-k, then top-p on what top-k kept, with one sort per row, in place (`k <= 0`, `p = 1`, None: off)."
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending: each row's most likely token is last
    if k is not None:
        k = torch.where(k <= 0, vocab, k.clamp(max=vocab))
        kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, _NEG_INF)
    if p is not None:
        mass_up_to = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # this token and every less likely one
        drop = mass_up_to <= 1 - p.unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)

# %%
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    "Drop the tokens less likely than `min_p` times the row's most likely token (`min_p = 0`: off), in place."
    probs = logits.softmax(dim=-1)
    too_unlikely = probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(too_unlikely, _NEG_INF)

# %%
def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator] | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    "Per row of `probs` (unnormalized, overwritten): argmax(p / E), E ~ Exp(1) drawn by `generators[i]` or `generator`."
    noise = torch.empty_like(probs)
    if not generators or len(generators) < probs.shape[0]:
        noise.exponential_(generator=generator)
    for row, generator in (generators or {}).items():
        noise[row].exponential_(generator=generator)
    return probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

# %%
@dataclass
class SamplingTensors:
    "The sampling parameters of one batch as tensors [B] on the logits' device, and what the batch as a whole needs."
    batch_size: int
    temperatures: torch.Tensor | None  # float32; greedy rows hold 1.0. None when the batch is all greedy
    greedy_mask: torch.Tensor | None   # bool, True where the row takes the argmax; None unless the batch mixes both
    top_k: torch.Tensor | None         # int64, 0 = off for that row; None when no row uses top-k
    top_p: torch.Tensor | None         # float32, 1.0 = off; None when no row uses top-p
    min_p: torch.Tensor | None         # float32, 0.0 = off; None when no row uses min-p
    max_top_k: int                     # the largest top_k of the batch (0 when none)
    num_logprobs: list[int | None]     # per row: SamplingParams.logprobs
    all_greedy: bool
    all_random: bool

    @property
    def max_num_logprobs(self) -> int | None:
        "The most log-probabilities any row asked for; None when no row asked (the common case)."
        return max((n for n in self.num_logprobs if n is not None), default=None)

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        greedy = [sp.greedy for sp in params]   # greedy rows: neutral values in every other list
        temps = [1.0 if g else sp.temperature for sp, g in zip(params, greedy)]
        top_k = [sp.top_k if sp.top_k > 0 and not g else 0 for sp, g in zip(params, greedy)]
        top_p = [1.0 if g else sp.top_p for sp, g in zip(params, greedy)]
        min_p = [0.0 if g else sp.min_p for sp, g in zip(params, greedy)]
        num_logprobs = [sp.logprobs for sp in params]
        all_greedy, all_random, max_top_k = all(greedy), not any(greedy), max(top_k)
        device = torch.device(device)
        pin = device.type == "cuda"   # through pinned memory: the copy does not block the host

        def tensor(values, dtype, needed=True):
            if not needed or all_greedy:
                return None
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)
        return cls(batch_size=len(params),
                   temperatures=tensor(temps, torch.float32),
                   greedy_mask=tensor(greedy, torch.bool, not all_random),
                   top_k=tensor(top_k, torch.int64, max_top_k > 0),
                   top_p=tensor(top_p, torch.float32, any(p < 1.0 for p in top_p)),
                   min_p=tensor(min_p, torch.float32, any(m > 0.0 for m in min_p)),
                   max_top_k=max_top_k, num_logprobs=num_logprobs, all_greedy=all_greedy, all_random=all_random)

# %%
class Sampler(nn.Module):
    "Logits [B, V] -> one token id per row [B], each row sampled with its own request's parameters."

    def forward(self, logits: torch.Tensor, sampling: SamplingTensors,
                generators: dict[int, torch.Generator] | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
        "`generators`: row -> the generator of a request with a seed; `generator`: the other rows' (see random_sample)."
        if sampling.all_greedy:
            return logits.argmax(dim=-1)
        greedy_ids = None if sampling.all_random else logits.argmax(dim=-1)
        logits = logits.float() / sampling.temperatures.unsqueeze(1)  # a new tensor: the filters work in place
        if sampling.top_p is not None:
            logits = apply_top_k_top_p(logits, sampling.top_k, sampling.top_p)
        elif sampling.top_k is not None:
            logits = apply_top_k(logits, sampling.top_k, sampling.max_top_k)
        if sampling.min_p is not None:
            logits = apply_min_p(logits, sampling.min_p)
        token_ids = random_sample(logits.softmax(dim=-1), generators, generator)
        return token_ids if greedy_ids is None else torch.where(sampling.greedy_mask, greedy_ids, token_ids)

# %%
@dataclass
class LogprobsTensors:
    "Per row: the sampled token, then the `n` most likely tokens (most likely first), with their raw log-probabilities."
    token_ids: torch.Tensor  # [B, 1 + n] int64
    logprobs: torch.Tensor   # [B, 1 + n] float32

    def tolists(self, num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
        "Per row, {token_id: logprob} with the sampled token first and the row's own top-n; None where not asked."
        ids, lps = self.token_ids.tolist(), self.logprobs.tolist()
        return [None if n is None else dict(zip(ids[row][:1 + n], lps[row][:1 + n]))
                for row, n in enumerate(num_logprobs)]


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    "Raw log-probabilities (log_softmax of `logits`) of the sampled `token_ids` and of each row's top `num_logprobs`."
    logprobs = logits.float().log_softmax(dim=-1)
    top, sampled = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1), token_ids.long().unsqueeze(1)
    return LogprobsTensors(torch.cat([sampled, top.indices], dim=1),
                           torch.cat([logprobs.gather(1, sampled), top.values], dim=1))
