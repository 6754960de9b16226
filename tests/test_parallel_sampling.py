"""SamplingParams.n (project issue 14): n samples of one prompt share the prompt's full KV blocks through the prefix
cache (allocated and computed once), come back as one RequestOutput with outputs indexed 0..n-1, derive each
sample's seed as vLLM does (seed + index), stream, and abort together under the parent's request id."""

import pytest

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.engine.llm_engine import LLMEngine

PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4, and 2 tokens in a fifth


@pytest.fixture(scope="module")
def llm():
    with LLM(TINY_MODEL_PATH, block_size=4, max_model_len=128) as llm:
        yield llm


def test_n_greedy_samples_equal_the_single_greedy_sample(llm):
    one = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    four = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, n=4), use_tqdm=False)[0]
    assert [o.index for o in four.outputs] == [0, 1, 2, 3] and four.finished
    assert all(o.token_ids == one.outputs[0].token_ids for o in four.outputs)
    assert four.prompt_token_ids == PROMPT and four.request_id != "0_" + four.request_id


def test_n_samples_allocate_and_compute_the_prompts_full_blocks_once():
    engine = LLMEngine(TINY_MODEL_PATH, block_size=4, max_model_len=128)
    try:
        free = engine.scheduler.block_manager.num_free_blocks
        engine.add_request("p", PROMPT, SamplingParams(temperature=0.7, seed=1, max_tokens=4, n=4))
        engine.step()
        tables = [s.block_table for s in engine.scheduler.running]
        assert len(tables) == 4 and all(t[:4] == tables[0][:4] for t in tables)  # the 4 full blocks: shared
        assert len({t[4] for t in tables}) == 4  # the partial ones: one each
        assert free - engine.scheduler.block_manager.num_free_blocks == 4 + 4  # not 4 x 5
        shared = engine.scheduler.block_manager.blocks[tables[0][0]]
        assert shared.ref_count == 4
        assert engine.stats.num_prompt_tokens == 18 + 3 * 2  # the full blocks' 16 tokens are computed once
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs) == 4  # (all 4 end in one step)
    finally:
        engine.close()


def test_each_sample_has_its_own_seed_the_requests_plus_its_index(llm):
    three = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7, max_tokens=10, n=3), use_tqdm=False)[0]
    singles = [
        llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10), use_tqdm=False)[0]
        for i in range(3)
    ]
    assert [o.token_ids for o in three.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(o.token_ids) for o in three.outputs}) > 1  # the samples differ


def test_n_samples_stream_and_abort_under_the_parents_id(llm):
    engine = llm.llm_engine
    seen = {0: [], 1: []}
    for out in llm.stream(PROMPT, SamplingParams(temperature=0.9, seed=3, max_tokens=5, n=2)):
        assert len(out.outputs) == 1
        seen[out.outputs[0].index] += out.outputs[0].token_ids
    assert len(seen[0]) == len(seen[1]) == 5
    # both samples end in the same step: `finished` only on the last delta, so a reader that stops there has all
    engine.add_request("both", PROMPT, SamplingParams(max_tokens=4, n=2, ignore_eos=True), stream=True)
    deltas = [o for _ in range(20) if engine.has_unfinished_requests() for o in engine.step()]
    assert [o.finished for o in deltas].index(True) == len(deltas) - 1
    assert sorted(sum((len(o.outputs[0].token_ids) for o in deltas if o.outputs[0].index == i), 0) for i in (0, 1)) == [
        4,
        4,
    ]
    request_id = engine.add_request(None, PROMPT, SamplingParams(max_tokens=50, n=3))
    engine.step()
    assert len(engine.requests) == 3 and set(engine.requests) == {f"{i}_{request_id}" for i in range(3)}
    engine.abort_request(request_id)
    assert not engine.requests and not engine.outputs.parents and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("q", PROMPT, SamplingParams(n=2))
        engine.add_request("0_q", PROMPT, SamplingParams())
    engine.abort_request("q")


def test_samples_that_finish_in_one_step_each_have_their_last_tokens_text(llm):
    """With a stop string the text is decoded token by token: the final output once went out when the first sample
    finishing in a step was booked, before the others' last tokens were (their text one token short)."""
    tokenizer = llm.get_tokenizer()
    for seed in range(4):
        params = SamplingParams(temperature=0.8, seed=seed, n=3, max_tokens=5, ignore_eos=True, stop=["zzzz"])
        out = llm.generate(["def f(x):"], params, use_tqdm=False)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 5 for c in out.outputs)
        for c in out.outputs:
            assert c.text == tokenizer.decode(c.token_ids), (seed, c.index, c.text, c.token_ids)


def test_an_aborted_sample_does_not_hold_back_the_others_output(llm):
    engine = llm.llm_engine
    engine.add_request("p", PROMPT, SamplingParams(temperature=0.7, seed=1, max_tokens=6, n=3))
    engine.step()
    engine.abort_request("1_p")  # one sample alone (its id as vLLM names children)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.request_id == "p" and o.finished]
    assert len(final) == 1 and [c.index for c in final[0].outputs] == [0, 1, 2]
    assert [len(c.token_ids) for c in final[0].outputs if c.index != 1] == [6, 6]
