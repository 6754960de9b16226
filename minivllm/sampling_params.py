from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

_SAMPLING_EPS = 1e-5  # below this temperature, sampling is greedy (vLLM uses the same threshold)


def _check_type(name: str, value, kinds: tuple, allow_none: bool = False):
    "Raise a TypeError naming the field unless `value` is one of `kinds` (bools are not numbers here)."
    if value is None and allow_none:
        return
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = {Integral: "an int", Real: "a number", bool: "True or False"}
        want = " or ".join(names.get(k, k.__name__) for k in kinds) + (" or None" if allow_none else "")
        raise TypeError(f"SamplingParams.{name} must be {want}, got {type(value).__name__} {value!r}")

# %%
@dataclass
class SamplingParams:
    "How to sample the tokens of one request (vLLM's field names and defaults)."
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        for name, kind, allow_none in (("temperature", Real, False), ("top_p", Real, False), ("top_k", Integral, False),
                                       ("min_p", Real, False), ("seed", Integral, True), ("max_tokens", Integral, True),
                                       ("ignore_eos", bool, False), ("logprobs", Integral, True)):
            _check_type(name, getattr(self, name), (kind,), allow_none)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise TypeError(f"SamplingParams.stop must be a non-empty string or a list of them, got {s!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"SamplingParams.stop_token_ids must be a list of ints, "
                            f"got {type(self.stop_token_ids).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must hold token ids >= 0, got {t!r}")
        self._check_ranges()

    def _check_ranges(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if self.top_k >= 2**63:   # the sampler holds top_k in an int64 tensor
            raise ValueError(f"SamplingParams.top_k must be below 2**63 (-1: all tokens), got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:   # torch.Generator.manual_seed's range
            raise ValueError(f"SamplingParams.seed must fit in 64 bits, got {self.seed}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"SamplingParams.logprobs must be >= 0, got {self.logprobs}")


    @property
    def greedy(self) -> bool:
        "True when the most likely token is always taken (temperature 0)."
        return self.temperature < _SAMPLING_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
