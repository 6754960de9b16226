"""Structured outputs, the grammar layer (notebooks/deep_dives/07_structured_outputs.ipynb): specs checked once,
compiled once per tokenizer, and masks that keep every decode inside its grammar while free rows stay untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from minivllm import TINY_MODEL_PATH
from minivllm.structured_outputs.grammar import GrammarCache
from minivllm.structured_outputs.params import StructuredOutputsParams
from minivllm.structured_outputs.state import GrammarState, allocate_bitmask, apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-f0-9]{2,6}(-[a-f0-9]{2})?"
CHOICE = ["red", "green", "blue", "a longer answer"]
GRAMMAR = 'root ::= "(" num (" " op " " num){0,2} ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= "+" | "*"'


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_PATH)


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCache(tokenizer, vocab_size=4096, stop_token_ids=[tokenizer.eos_token_id])


def valid(kind: str, text: str) -> bool:
    if kind == "json":  # (xgrammar's JSON strings, as vLLM's, may hold control characters other than newlines)
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        return True
    if kind == "choice":
        return text in CHOICE
    pattern = REGEX if kind == "regex" else r"\([0-9]{1,2}( [+*] [0-9]{1,2}){0,2}\)"
    return re.fullmatch(pattern, text) is not None


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(), "exactly one of json, regex, choice, grammar, json_object, got none"),
        (dict(regex="a", choice=["a"]), "got regex, choice"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", ""]), "choice must be a non-empty list"),
        (dict(json="{not json"), "json is not valid JSON"),
        (dict(json=3), "json must be a JSON schema"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(json_object="yes"), "json_object must be True or None"),
    ],
)
def test_bad_specs_are_refused_by_name(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "spec, error",
    [
        (dict(regex="[0-9"), "regex cannot be compiled: Regex parsing error"),
        (dict(json={"type": "nonsense"}), 'json cannot be compiled: Unsupported type "nonsense"'),
        (
            dict(grammar="root ::= foo"),
            'grammar cannot be compiled: EBNF parser error at line 1, column 10: Rule "foo"',
        ),
    ],
)
def test_specs_that_do_not_compile_are_a_value_error(cache, spec, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        cache.get(StructuredOutputsParams(**spec))


def test_each_spec_compiles_once(cache):
    first = cache.get(StructuredOutputsParams(json=dict(SCHEMA)))
    assert cache.get(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))) is not first  # other text
    assert cache.get(StructuredOutputsParams(json=dict(reversed(list(SCHEMA.items()))))) is first  # same dict
    assert cache.get(StructuredOutputsParams(choice=["x", "y"])) is cache.get(
        StructuredOutputsParams(choice=["x", "y"])
    )


def test_a_hundred_constrained_decodes_all_validate_and_free_rows_are_untouched(cache, tokenizer):
    "25 rows of each kind plus 4 free rows in one batch, random logits, greedy: every row ends, and validates."
    kinds = {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICE),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    }
    rows = [kind for kind in kinds for _ in range(25)]
    states = [GrammarState(cache.get(kinds[kind])) for kind in rows]
    free = list(range(len(rows), len(rows) + 4))
    bitmask = allocate_bitmask(len(rows) + len(free), cache.vocab_size)
    outputs: list[list[int]] = [[] for _ in rows]
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        live = [i for i, s in enumerate(states) if not s.finished]
        if not live:
            break
        logits = torch.randn(len(rows) + len(free), cache.vocab_size, generator=generator)
        before = logits[free].clone()
        for i in live:
            states[i].fill(bitmask, i)
        apply_bitmask(logits, bitmask, live)
        assert torch.equal(logits[free], before)
        tokens = logits.argmax(-1).tolist()
        for i in live:
            assert states[i].accept(tokens[i]), (rows[i], tokenizer.decode(outputs[i]), tokens[i])
            if tokens[i] != tokenizer.eos_token_id:
                outputs[i].append(tokens[i])
    assert all(s.finished for s in states)
    texts = [tokenizer.decode(o) for o in outputs]
    assert all(valid(kind, text) for kind, text in zip(rows, texts, strict=True)), texts
    assert len({t for kind, t in zip(rows, texts, strict=True) if kind == "choice"}) > 1  # not one forced answer


def test_the_mask_forbids_exactly_what_the_grammar_forbids(cache, tokenizer):
    state = GrammarState(cache.get(StructuredOutputsParams(choice=["yes", "no"])))
    bitmask = allocate_bitmask(1, cache.vocab_size)
    state.fill(bitmask, 0)
    logits = torch.zeros(1, cache.vocab_size)
    apply_bitmask(logits, bitmask, [0])
    allowed = [tokenizer.decode([t]) for t in torch.nonzero(logits[0] == 0).flatten().tolist()]
    assert sorted(allowed) == ["n", "no", "y"]
    assert not state.accept(tokenizer.encode("maybe")[0])  # a token the mask forbids is refused by the matcher too


def test_proposals_are_cut_where_the_grammar_stops_allowing_them(cache, tokenizer):
    "A speculative proposal keeps its longest allowed prefix; the state is left where it was."
    state = GrammarState(cache.get(StructuredOutputsParams(regex="(ab)+c")))
    a, b, c = (tokenizer.encode(s)[0] for s in "abc")
    assert state.valid_prefix([a, b, a, c, a]) == [a, b, a]
    assert state.valid_prefix([b, a]) == []
    assert state.num_accepted == 0 and state.accept(a)  # nothing was kept: the grammar still starts with "a"
    eos = tokenizer.eos_token_id
    assert state.valid_prefix([b, c, eos, a]) == [b, c, eos]  # nothing after a stop token


def test_masks_ahead_equal_the_masks_after_each_proposal(cache, tokenizer):
    "Row j of a speculative step's mask is the mask after the first j proposals, filled without moving the state."
    spec = StructuredOutputsParams(json=SCHEMA)
    tokens = tokenizer.encode('{"name": "ab", "ok": true, "n": 12')
    ahead = GrammarState(cache.get(spec))
    bitmask = allocate_bitmask(len(tokens) + 1, cache.vocab_size)
    ahead.fill_ahead(bitmask, 0, tokens)
    one_by_one = GrammarState(cache.get(spec))
    expected = allocate_bitmask(len(tokens) + 1, cache.vocab_size)
    for j, token in enumerate(tokens):
        one_by_one.fill(expected, j)
        assert one_by_one.accept(token)
    one_by_one.fill(expected, len(tokens))
    assert torch.equal(bitmask, expected)
    assert ahead.num_accepted == 0 and ahead.valid_prefix(tokens) == tokens
