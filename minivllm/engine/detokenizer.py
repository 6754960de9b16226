from __future__ import annotations


class IncrementalDetokenizer:
    "Text of a growing completion, a few tokens at a time (vLLM's / TGI's prefix and read offsets)."

    def __init__(self, tokenizer, prompt_token_ids: list[int], context: int = 5):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-context:])   # a little prompt, so the first token decodes in context
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        "Append new token ids; return the new text they complete (possibly empty)."
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

# %%
def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    "The earliest stop string that ends in the last `new_chars` characters of `text`: (where it starts, which)."
    best = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best
