"""What a vLLM user reaches for (project issue 14): default sampling from the checkpoint's generation_config.json,
Qwen3's chat template switches, vLLM's order of LLMEngine.add_request, and unsupported vLLM fields named as such."""

import json
import shutil

import pytest

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.__main__ import main
from minivllm.engine.llm_engine import LLMEngine

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)  # Qwen3's switch


def model_copy(tmp_path, generation_config: dict | None = None, chat_template: str | None = None) -> str:
    folder = tmp_path / "model"
    shutil.copytree(TINY_MODEL_PATH, folder)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    if chat_template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return str(folder)


def test_generate_without_params_uses_the_checkpoints_generation_config(tmp_path):
    given = {
        "eos_token_id": 0,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "max_new_tokens": 12,
        "do_sample": True,
    }
    folder = model_copy(tmp_path, given)
    with LLM(folder, max_model_len=64) as llm:
        defaults = llm.get_default_sampling_params()
        assert (
            defaults.temperature,
            defaults.top_k,
            defaults.top_p,
            defaults.repetition_penalty,
            defaults.max_tokens,
        ) == (0.6, 20, 0.95, 1.1, 12)
        defaults.temperature = 0.0
        assert llm.get_default_sampling_params().temperature == 0.6  # a copy: the engine's defaults stay
        out = llm.generate(["def f(x):"] * 3, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in out)
        explicit = llm.generate(["def f(x):"], SamplingParams(), use_tqdm=False)[0]
        assert len(explicit.outputs[0].token_ids) == 16  # SamplingParams() itself keeps vLLM's defaults
    with LLM(folder, max_model_len=64, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config.json .*top_p"):
        LLM(model_copy(tmp_path / "bad", {"top_p": 0.0}))
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(folder, generation_config="hub")


def test_chat_template_kwargs_reach_the_template(tmp_path, capsys):
    folder = model_copy(tmp_path, chat_template=THINKING_TEMPLATE)
    messages = [{"role": "user", "content": "Write a loop."}]
    with LLM(folder, max_model_len=64) as llm:
        thinking = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        direct = llm.chat(
            messages,
            SamplingParams(temperature=0, max_tokens=4),
            use_tqdm=False,
            chat_template_kwargs={"enable_thinking": False},
        )[0]
    assert thinking.prompt.endswith("<|im_start|>assistant\n")
    assert direct.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (
        main(
            [
                "--model",
                folder,
                "--chat",
                "--no-thinking",
                "--no-stream",
                "--max-tokens",
                "3",
                "Write a loop.",
                "Another one.",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("<think>\n\n</think>") == 2
    assert main(["--model", folder, "--chat", "--no-thinking", "--max-tokens", "3", "Write a loop."]) == 0
    assert "<think>\n\n</think>" in capsys.readouterr().out


def test_add_request_takes_vllms_order_and_abort_takes_a_list():
    engine = LLMEngine(TINY_MODEL_PATH, max_model_len=64)
    try:
        assert engine.add_request("a", "def f(x):", SamplingParams(temperature=0, max_tokens=4)) == "a"
        engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=50))
        engine.add_request("c", {"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=50))
        engine.abort_request(["b", "c"])
        assert set(engine.requests) == {"a"}
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in done] == ["a"] and len(done[0].outputs[0].token_ids) == 4
    finally:
        engine.close()


@pytest.mark.parametrize(
    "name,value",
    [
        ("logits_processors", [print]),
        ("truncate_prompt_tokens", 5),
        ("detokenize", False),
        ("best_of", 2),
    ],
)
def test_unsupported_vllm_fields_are_named(name, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{name} is a vLLM field that minivllm does not support"):
        SamplingParams(**{name: value})
    SamplingParams(**{name: {"detokenize": True}.get(name)})  # the value that means "not used" is accepted


def test_include_stop_str_in_output_and_special_tokens():
    prompt = "def fibonacci(n):"
    with LLM(TINY_MODEL_PATH, max_model_len=128) as llm:
        base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0].text
        stop = base[6:10]
        cut, kept = (
            llm.generate(
                prompt,
                SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=keep),
                use_tqdm=False,
            )[0].outputs[0]
            for keep in (False, True)
        )
        assert cut.text == base[:6] and kept.text == base[:10] and kept.stop_reason == stop
        streamed = "".join(
            d.outputs[0].text
            for d in llm.stream(
                prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True)
            )
        )
        assert streamed == kept.text
        eos = llm.llm_engine.config.eos_token_ids[0]
        special = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
        skipped, shown = (
            llm.generate(prompt, SamplingParams(skip_special_tokens=skip, **special), use_tqdm=False)[0].outputs[0]
            for skip in (True, False)
        )
        name = llm.get_tokenizer().decode([eos])
        assert skipped.token_ids == shown.token_ids == [eos] * 3
        assert skipped.text == "" and shown.text == name * 3


def test_token_ids_and_bad_words_are_checked_against_the_model():
    with LLM(TINY_MODEL_PATH, max_model_len=64) as llm:
        for bad, match in [
            (dict(stop_token_ids=[4096]), "stop_token_ids holds token id 4096"),
            (dict(allowed_token_ids=[1, 5000]), "allowed_token_ids holds token id 5000"),
            (dict(logit_bias={4100: 1.0}), "logit_bias holds token id 4100"),
            (dict(bad_words=["x" * 400]), "bad word .* tokens; it must be 1 to 17"),
        ]:
            with pytest.raises(ValueError, match=f"prompt 1: .*{match}"):
                llm.generate(["a", "b"], [SamplingParams(), SamplingParams(**bad)], use_tqdm=False)
            assert not llm.llm_engine.requests  # nothing of the refused call was queued
        words = llm.llm_engine.validate("a", SamplingParams(bad_words=["fibonacci"]))[2].bad_words_token_ids
        assert words and all(1 <= len(w) <= 17 for w in words)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["hi", "--max-tokens", "0"], "python -m minivllm: error: SamplingParams.max_tokens must be at least 1, got 0"),
        (["hi", "--model", "/nonexistent"], "python -m minivllm: error: model path '/nonexistent' is not a folder"),
        (["hi", "--device", "tpu"], "python -m minivllm: error: device must be 'auto', 'cpu' or 'cuda', got 'tpu'"),
        (["", "--device", "cpu"], "python -m minivllm: error: prompt is empty: it needs at least one token"),
        (["serve", "/nonexistent"], "minivllm serve: error: model path '/nonexistent' is not a folder"),
        (
            ["serve", TINY_MODEL_PATH, "--device", "cpu", "--max-num-seqs", "0"],
            "minivllm serve: error: max_num_seqs must be at least 1, got 0",
        ),
    ],
)
def test_the_command_line_says_a_bad_value_in_one_line(argv, message, capsys):
    "A value the engine refuses: the message alone, exit status 2 (it printed the whole traceback)."
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--port", "70000"),
        ("--port", "-1"),
        ("--log-level", "bogus"),
        ("--max-waiting-requests", "-1"),
        ("--max-request-bytes", "0"),
    ],
)
def test_serve_refuses_a_bad_flag_before_loading_the_model(flag, value, capsys):
    "uvicorn failed on these after the model had loaded (a traceback), or served nothing (every request 503 or 413)."
    with pytest.raises(SystemExit) as e:
        main(["serve", TINY_MODEL_PATH, flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_llm():
    with LLM(TINY_MODEL_PATH, max_model_len=64) as llm:
        yield llm


@pytest.mark.parametrize(
    "messages,error,message",
    [
        ({"role": "user", "content": "Hi"}, TypeError, "chat\\(\\) takes a conversation .* got dict"),  # (a KeyError)
        ([{"content": "Hi"}], TypeError, "conversation 0, message 0 needs a 'role' string"),  # (jinja's UndefinedError)
        (
            [{"role": "user"}],
            TypeError,
            "conversation 0, message 0: 'content' must be a string or a list of text parts",
        ),
        ([{"role": "user", "content": 42}], TypeError, "'content' must be a string"),  # (str + int, in the template)
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            TypeError,
            "no images here",
        ),
    ],
)
def test_chat_names_a_malformed_message(tiny_llm, messages, error, message):
    with pytest.raises(error, match=message):
        tiny_llm.chat(messages, use_tqdm=False)


def test_chat_joins_text_parts_and_refuses_bytes_as_a_prompt(tiny_llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert tiny_llm.chat_prompts(parts) == tiny_llm.chat_prompts([{"role": "user", "content": "Hi\nthere"}])  # vLLM's
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict, got list"):
        tiny_llm.chat_prompts(parts, chat_template_kwargs=["x"])
    with pytest.raises(ValueError, match="the chat template failed: TemplateError: boom"):  # (jinja's own class)
        tiny_llm.chat_prompts(parts, chat_template_kwargs={"chat_template": "{{ raise_exception('boom') }}"})
    for prompt in (b"hello", bytearray(b"hi")):  # (read as token ids 104, 101, ...: a silent wrong answer)
        with pytest.raises(TypeError, match="prompts must be a string, a list of token ids"):
            tiny_llm.generate(prompt, use_tqdm=False)


@pytest.mark.parametrize(
    "argv,message",
    [(["hi", "--no-thinking"], "--no-thinking needs --chat"), (["hi", "--demo"], "--demo brings its prompts")],
)
def test_the_command_line_refuses_a_flag_it_would_ignore(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_empty_model_path_is_not_the_working_directory():
    with pytest.raises(ValueError, match="model path '' is not a folder"):
        LLM("")
