from __future__ import annotations

import dataclasses
import os
from numbers import Integral

from transformers import AutoTokenizer

from ..sampling_params import SamplingParams

PromptType = str | list[int] | dict
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")   # any one of them holds a vocabulary
_NO_TOKENIZER = "or pass skip_tokenizer_init=True and give prompts as token ids"


def load_tokenizer(model: str, vocab_size: int):
    if not any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
        # transformers would make an empty tokenizer from config.json alone, which turns every prompt into []
        raise ValueError(f"no tokenizer in {model!r}: none of {', '.join(TOKENIZER_FILES)} is there; copy the "
                         f"checkpoint's tokenizer files into the folder, {_NO_TOKENIZER}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot load the tokenizer in {model!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                         f"fix its files, {_NO_TOKENIZER}") from None
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer in {model!r} has {len(tokenizer)} tokens, the model only {vocab_size}: "
                         "they do not belong together")
    return tokenizer

# %%
def prompt_token_ids(prompt: PromptType, tokenizer, vocab_size: int, max_model_len: int,
                     name: str = "prompt") -> tuple[str | None, list[int]]:
    "(text, token ids) of one prompt, or a TypeError / ValueError naming `name` and the problem."
    if isinstance(prompt, dict):
        if set(prompt) - {"prompt", "prompt_token_ids"} or len(prompt) != 1:
            raise TypeError(f"{name}: a prompt dict holds exactly one of 'prompt' or 'prompt_token_ids', "
                            f"got keys {sorted(prompt)}")
        key, prompt = next(iter(prompt.items()))
        if not isinstance(prompt, str if key == "prompt" else (list, tuple)):
            want = "a string" if key == "prompt" else "a list of token ids"
            raise TypeError(f"{name}: {key!r} must be {want}, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{name} is text, but the engine has no tokenizer (skip_tokenizer_init=True): "
                             "pass token ids")
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        text, ids = None, list(prompt)
        if set(map(type, ids)) != {int}:   # plain ints: one pass in C; numpy ints and such: the slow path
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)), None)
            if bad is not None:
                raise TypeError(f"{name}: token ids must be ints, got {type(bad).__name__} {bad!r}")
            ids = [int(t) for t in ids]
        if ids and not (0 <= min(ids) and max(ids) < vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    else:
        raise TypeError(f"{name} must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"{name} is empty: it needs at least one token")
    if len(ids) >= max_model_len:
        raise ValueError(f"{name} has {len(ids)} tokens; with max_model_len={max_model_len} a prompt may have at "
                         f"most {max_model_len - 1}, so that at least one token can be generated")
    return text, ids

# %%
def checked_params(params: SamplingParams | None, name: str = "prompt") -> SamplingParams:
    "A validated private copy of `params` (the defaults for None), or a TypeError / ValueError naming `name`."
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{name}: sampling params must be a SamplingParams, got {type(params).__name__}")
    try:
        return dataclasses.replace(params)   # runs every check of SamplingParams again
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
