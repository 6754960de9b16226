"""The chat data and the evaluation of ``tools/train_tiny_qwen3.py`` (the script that makes the embedded model).

Offline and on CPU: conversations built from documented definitions, the answer check (parses, defines the
name asked for), the masked chat windows, bits per byte, and the held-out requests (from held-out files only).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

SOURCE = '''"""A module."""
import os


def plain(a, b=2, *rest, key: int = 0) -> int:
    """Add two numbers.

    More detail that the request leaves out.
    """
    return a + b


def undocumented(x):
    return x


class Box(dict):
    """A box of things."""

    def put(self, name):
        """Put one thing in the box."""
        self[name] = True

    def _hidden(self):
        pass
'''


SMALL_MODEL = {
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}  # overrides of the script's MODEL_CONFIG for quick runs


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    from minivllm.tiny_model import TINY_MODEL_PATH

    return Tokenizer.from_file(str(Path(TINY_MODEL_PATH) / "tokenizer.json"))


def test_documented_definitions_are_found_with_their_source(train_script) -> None:
    found = {d.qualname: d for d in train_script.documented_definitions(SOURCE, "pkg/mod.py")}
    assert list(found) == ["plain", "Box", "Box.put"]  # undocumented ones are skipped
    plain, box, put = found["plain"], found["Box"], found["Box.put"]
    assert (plain.kind, box.kind, put.kind) == ("function", "class", "method")
    assert plain.signature == "plain(a, b=2, *rest, key: int=0) -> int"
    assert box.signature == "Box(dict)" and put.signature == "put(self, name)"
    assert plain.doc == "Add two numbers."  # the first paragraph only
    assert put.source == 'def put(self, name):\n    """Put one thing in the box."""\n    self[name] = True'
    for d in found.values():  # every source is valid Python on its own, at the top level
        assert train_script.defines(train_script.chat_answer(d), d.name)


def test_requests_name_what_they_ask_for(train_script) -> None:
    for d in train_script.documented_definitions(SOURCE, "pkg/mod.py"):
        request = train_script.chat_request(d)
        assert d.signature in request and d.doc in request
        assert request == train_script.chat_request(d)  # the phrasing is chosen by a stable hash
    put = train_script.documented_definitions(SOURCE, "pkg/mod.py")[-1]
    assert "Box" in train_script.chat_request(put)  # a method names its class


def test_doc_summary_is_one_line_and_bounded(train_script) -> None:
    assert train_script.doc_summary("Do it.\n   Carefully.\n\nNot this.") == "Do it. Carefully."
    long = train_script.doc_summary("word " * 200, max_chars=50)
    assert len(long) <= 54 and long.endswith(" ...")


@pytest.mark.parametrize(
    "answer, name, expected",
    [
        ("```python\ndef f(x):\n    return x\n```", "f", True),
        ("Sure:\n```python\nclass K:\n    pass\n```\nDone.", "K", True),
        ("```python\ndef f(x):\n    return x\n", "f", True),  # unclosed block: the rest is the code
        ("def f(x):\n    return x\n", "f", True),  # no block: all of it is the code
        ("```python\ndef g(x):\n    return x\n```", "f", False),  # another name
        ("```python\ndef f(x:\n    return x\n```", "f", False),  # does not parse
        ("```python\ndef outer():\n    def f():\n        pass\n```", "f", False),  # not at the top level
        ("```python\ndef f(x):\n    if x:\n", "f", False),  # cut off mid-body
    ],
)
def test_defines(train_script, answer: str, name: str, expected: bool) -> None:
    assert train_script.defines(answer, name) is expected


def test_chat_prompt_is_the_tokenizers_chat_template(train_script) -> None:
    from minivllm.tiny_model import TINY_MODEL_PATH

    hf_tokenizer = train_script.load_tokenizer(Path(TINY_MODEL_PATH))
    messages = [{"role": "user", "content": "Write `f(x)`: Return x."}]
    assert train_script.chat_prompt("Write `f(x)`: Return x.") == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_conversations_spans_and_masked_windows(train_script, tokenizer) -> None:
    definitions = train_script.documented_definitions(SOURCE, "pkg/mod.py")
    chat_ids, spans = train_script.conversations(tokenizer, definitions)
    assert len(spans) == len(definitions)
    chat = torch.from_numpy(chat_ids.astype("int64"))
    for d, (start, answer, end) in zip(definitions, spans.tolist()):
        assert tokenizer.decode(chat[start:answer].tolist(), skip_special_tokens=False) == train_script.chat_prompt(
            train_script.chat_request(d)
        )
        assert (
            tokenizer.decode(chat[answer:end].tolist(), skip_special_tokens=False)
            == train_script.chat_answer(d) + "<|im_end|>\n"
        )
        assert int(chat[end]) == tokenizer.token_to_id("<|endoftext|>")

    cfg = train_script.TrainConfig(seq_len=64)
    inputs, targets = train_script.sample_chat_batch(
        chat, torch.from_numpy(spans), 8, cfg, torch.Generator().manual_seed(0)
    )
    assert inputs.shape == targets.shape == (8, 64)
    for row_inputs, row_targets in zip(inputs, targets):
        start = next(s for s in spans.tolist() if chat[s[0] : s[0] + 64].tolist() == row_inputs.tolist())
        kept = (row_targets != train_script.IGNORE).nonzero().flatten()
        # targets are exactly the answer's tokens (those inside the window), each the next token of the input
        assert kept.tolist() == [j for j in range(64) if start[1] <= start[0] + j + 1 < start[2]]
        assert row_targets[kept].tolist() == chat[start[0] + 1 + kept].tolist()


def test_conversations_longer_than_a_window_are_dropped(train_script, tokenizer, monkeypatch) -> None:
    definitions = train_script.documented_definitions(SOURCE, "pkg/mod.py")
    lengths = [sum(map(len, train_script.encode_conversation(tokenizer, d))) for d in definitions]
    monkeypatch.setattr(train_script, "CHAT_MAX_TOKENS", sorted(lengths)[1])
    _, spans = train_script.conversations(tokenizer, definitions)
    assert len(spans) == 2


def test_bits_per_byte_counts_utf8_bytes(train_script) -> None:
    from minivllm.tiny_model import TINY_MODEL_PATH

    hf_tokenizer = train_script.load_tokenizer(Path(TINY_MODEL_PATH))
    text = 'def salut(nom):\n    return f"« {nom} » 🐍"\n'
    ids = torch.tensor(hf_tokenizer.encode(text) + [hf_tokenizer.eos_token_id])
    nbytes = train_script.token_bytes(hf_tokenizer)
    assert int(nbytes[ids].sum()) == len(text.encode("utf-8"))  # the end-of-text token counts no byte
    assert train_script.bits_per_byte(math.log(2), ids, nbytes) == pytest.approx(len(ids) / len(text.encode("utf-8")))


def test_heldout_requests_come_from_heldout_files_only(train_script, tokenizer) -> None:
    requests = train_script.heldout_requests(tokenizer)
    assert len(requests) == train_script.CHAT_EVAL_REQUESTS
    assert all(train_script.split_of(r["path"]) == "heldout" for r in requests)
    assert len({(r["path"], r["qualname"]) for r in requests}) == len(requests)
    for r in requests[:10]:
        source = (train_script.stdlib_root() / r["path"]).read_text(encoding="utf-8")
        names = {n.name for n in ast.walk(ast.parse(source)) if hasattr(n, "name")}
        assert r["name"] in names and r["name"] in r["request"]


def test_training_mixes_conversations_in_and_leaves_no_dropout_behind(train_script, tokenizer) -> None:
    chat_ids, spans = train_script.conversations(tokenizer, train_script.documented_definitions(SOURCE, "pkg/mod.py"))
    data = {
        "train": torch.randint(3, 4096, (2048,), generator=torch.Generator().manual_seed(0)),
        "heldout": torch.randint(3, 4096, (256,), generator=torch.Generator().manual_seed(1)),
        "chat": torch.from_numpy(chat_ids.astype("int64")),
        "spans": torch.from_numpy(spans),
    }
    cfg = train_script.TrainConfig(
        steps=4, batch_size=4, seq_len=32, chat_steps=2, dropout=0.3, log_every=2, eval_every=0, warmup_steps=1
    )
    batch = train_script.mixed_batch(3, data, cfg, torch.Generator().manual_seed(0))
    ignore = train_script.IGNORE
    assert (batch[1][:2] != ignore).all() and (batch[1][2:] == ignore).any()  # plain rows, chat rows
    model = train_script.build_model(0, overrides=SMALL_MODEL)
    before = [p.detach().clone() for p in model.parameters()]
    train_script.train_model(model, data, cfg, torch.device("cpu"))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert model.config.attention_dropout == 0.0
    model.eval()
    ids = data["heldout"][:32][None]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # no dropout in eval


def random_tokens() -> dict:
    "Random train and held-out ids for the training-loop tests."
    return {
        "train": torch.randint(3, 4096, (2048,), generator=torch.Generator().manual_seed(0)),
        "heldout": torch.randint(3, 4096, (256,), generator=torch.Generator().manual_seed(1)),
    }


def trained_weights(train_script, **ema) -> list[torch.Tensor]:
    "The weights of SMALL_MODEL after 2 steps on `random_tokens()` with these EMA settings."
    cfg = train_script.TrainConfig(steps=2, batch_size=2, seq_len=32, log_every=1, eval_every=0, warmup_steps=1, **ema)
    model = train_script.build_model(0, overrides=SMALL_MODEL)
    train_script.train_model(model, random_tokens(), cfg, torch.device("cpu"))
    return [p.detach().clone() for p in model.parameters()]


def test_ema_saves_the_moving_average_of_the_weights(train_script, capsys) -> None:
    data = random_tokens()
    runs = {}
    for decay in (0.0, 0.25):
        cfg = train_script.TrainConfig(
            steps=1, batch_size=2, seq_len=32, log_every=1, eval_every=0, warmup_steps=1, ema=decay
        )
        model = train_script.build_model(0, overrides=SMALL_MODEL)
        runs[decay] = ([p.detach().clone() for p in model.parameters()], model)
        train_script.train_model(model, data, cfg, torch.device("cpu"))
    (start, last), (_, averaged) = runs[0.0], runs[0.25]
    for p0, p1, pa in zip(start, last.parameters(), averaged.parameters()):  # one step: 0.25 start + 0.75 last
        torch.testing.assert_close(pa, 0.25 * p0 + 0.75 * p1)
    assert "moving average" in capsys.readouterr().out


def test_ema_start_averages_from_that_steps_weights(train_script) -> None:
    after_first = trained_weights(train_script, ema=1.0, ema_start=1)  # decay 1 keeps the weights it started from
    last = trained_weights(train_script)
    for p1, p2, pa in zip(after_first, last, trained_weights(train_script, ema=0.25, ema_start=1)):  # 0.25 + 0.75
        assert not torch.equal(p1, p2)
        torch.testing.assert_close(pa, 0.25 * p1 + 0.75 * p2)


def test_ema_until_trains_on_from_the_average(train_script, capsys) -> None:
    start = [p.detach().clone() for p in train_script.build_model(0, overrides=SMALL_MODEL).parameters()]
    capsys.readouterr()
    polished = trained_weights(train_script, ema=1.0, ema_until=1)  # the average is the first weights (decay 1);
    # step 1 trains from them
    log = capsys.readouterr().out
    assert log.index("moving average") < log.index("step     2/2")  # replaced at step 1, then trained on
    last, averaged = trained_weights(train_script), trained_weights(train_script, ema=1.0)
    for p0, pp, pl, pa in zip(start, polished, last, averaged):
        torch.testing.assert_close(pa, p0)  # without --ema-until the average is what is saved
        assert not torch.equal(pp, p0) and not torch.equal(pp, pl)


@pytest.mark.parametrize(
    "flags",
    [
        ["--ema-until", "5"],
        ["--ema", "0.9", "--ema-until", "10"],
        ["--ema", "0.9", "--ema-start", "5", "--ema-until", "5"],
    ],
)
def test_ema_until_must_follow_the_start_within_the_run(train_script, flags) -> None:
    args = train_script.parse_args(["train", "--out", "x", "--steps", "10", *flags])
    with pytest.raises(SystemExit, match="--ema-until needs --ema"):
        train_script.train_config(args)


def test_ema_start_must_be_a_step_of_the_run(train_script) -> None:
    args = train_script.parse_args(["train", "--out", "x", "--steps", "10", "--ema", "0.9", "--ema-start", "10"])
    with pytest.raises(SystemExit, match="--ema-start must be a step of the run"):
        train_script.train_config(args)


def test_dropout_rate_can_change_and_turn_off(train_script) -> None:
    model = train_script.build_model(0, overrides=SMALL_MODEL)
    set_rate = train_script.add_dropout(model, 0.5)
    model.train()
    ids = torch.arange(3, 35)[None]
    assert model.config.attention_dropout == 0.5
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # dropout is on
    set_rate(0.0)  # e.g. the chat stage's rate, or before saving
    assert model.config.attention_dropout == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # and now off, even training
