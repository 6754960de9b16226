"""SamplingParams: vLLM's field names and defaults, and a clear error for every bad value."""

import pytest

from minivllm.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (1.0, 1.0, 0, 0.0, None, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ([], [], False, None)
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (1, 0.0, 0.0, 1.0, 0)
    assert (p.bad_words, p.include_stop_str_in_output, p.prompt_logprobs, p.logit_bias, p.allowed_token_ids) == (
        [],
        False,
        None,
        None,
        None,
    )
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.changes_logits
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_normalizes_stop_lists():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=10**12), "SamplingParams.n"),  # (the engine would queue samples without end)
        (dict(seed=2**64 - 1, n=2), "the last sample's"),  # the second sample's seed, 2**64, would fail in the engine
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(logit_bias={3: float("inf")}), "logit_bias"),  # (-inf is allowed: it bans the token)
        (dict(max_tokens=-3), "max_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
        (dict(n=0), "n"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    ],
)
def test_bad_values_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_k=2.0), "top_k"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(seed="42"), "seed"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (
            dict(stop=5),
            "SamplingParams.stop must be a string or a list of strings",
        ),  # (was "'int' object is not iterable")
        (dict(bad_words=3), "SamplingParams.bad_words must be a string or a list of strings"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(logprobs=0.5), "logprobs"),
        (dict(n=2.0), "n"),
        (dict(min_tokens=None), "min_tokens"),
        (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
        (dict(logit_bias={1: "2"}), "logit_bias"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(skip_special_tokens="no"), "skip_special_tokens"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(allowed_token_ids=7), "allowed_token_ids"),
    ],
)
def test_wrong_types_are_type_errors_naming_the_field(kwargs, field):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**kwargs)


def test_unknown_field_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)


def test_accepted_edge_values():
    p = SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1.0, max_tokens=None, seed=0, logprobs=0)
    assert p.greedy and not p.top_k_enabled and p.max_tokens is None
    assert SamplingParams(top_k=5).top_k_enabled and not SamplingParams(top_k=-1).top_k_enabled
    p = SamplingParams(
        n=3,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.5,
        min_tokens=16,
        logit_bias={3: -100, 4: 0.5},
        allowed_token_ids=(1, 2),
        bad_words=["x y"],
        prompt_logprobs=0,
    )
    assert p.logit_bias == {3: -100.0, 4: 0.5} and p.allowed_token_ids == [1, 2] and p.changes_logits
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50
