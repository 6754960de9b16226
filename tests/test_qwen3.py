"""Qwen3ForCausalLM, the safetensors loader and the model registry (notebook 07).

Parity: our logits vs transformers' Qwen3ForCausalLM in float32, on the embedded tiny model and on random Qwen3s of
several shapes, saved by `save_pretrained` and loaded through `load_model(model, folder, QWEN3_PACKED_WEIGHTS)`. Several
sequences of different lengths are packed into one step (cu_seqlens in an AttentionMetadata) and compared with
transformers run on each sequence alone. The tolerance is relative
to the logits' scale: `max |ours - theirs| / max |theirs| < 1e-4`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from _net import free_port
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from minivllm.layers.attention import Attention, AttentionMetadata
from minivllm.layers.kernel_policy import apply_policy, kernel_policy
from minivllm.layers.rotary_embedding import RotaryEmbedding
from minivllm.models.loader import load_model, load_weights
from minivllm.models.qwen3 import QWEN3_PACKED_WEIGHTS, Qwen3ForCausalLM
from minivllm.models.registry import MODEL_REGISTRY, ModelSpec, build_model, load_config, model_spec
from minivllm.tiny_model import TINY_MODEL_PATH

RTOL = 1e-4


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    "max |ours - theirs| / max |theirs|: the error relative to the scale of the logits."
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def prefill_meta(lens: list[int], device="cpu") -> AttentionMetadata:
    "A step that prefills whole sequences of these lengths, with no KV cache."
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    return AttentionMetadata(cu, cu, max(lens), max(lens))


def our_logits(model: Qwen3ForCausalLM, seqs: list[torch.Tensor]) -> torch.Tensor:
    "Logits of every token of `seqs`, all packed into one flat step."
    lens = [len(s) for s in seqs]
    device = next(model.parameters()).device
    ids = torch.cat(seqs).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, prefill_meta(lens, device)))


def hf_logits(hf, seqs: list[torch.Tensor]) -> torch.Tensor:
    "transformers' logits, one sequence at a time."
    device = next(hf.parameters()).device
    with torch.no_grad():
        return torch.cat([hf(s[None].to(device)).logits[0] for s in seqs])


def random_seqs(vocab: int, lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lens]


# ---------------------------------------------------------------- random Qwen3 checkpoints

BASE = dict(
    vocab_size=131,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=True,
)

CONFIGS = {
    # grouped-query attention, heads * head_dim (128) > hidden (64), tied embeddings
    "gqa_wide_tied": {},
    # multi-head attention, heads * head_dim == hidden, untied embeddings, rope base 10,000
    "mha_untied": dict(
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    ),
    # one KV head, heads * head_dim (32) < hidden (40), attention biases, untied
    "mqa_narrow_bias": dict(
        hidden_size=40,
        intermediate_size=72,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
    # deeper, 4 query heads per KV head, tied
    "gqa4_three_layers": dict(
        hidden_size=96,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=200,
    ),
}


def make_hf(**overrides) -> HFQwen3ForCausalLM:
    "A transformers Qwen3 with seeded random weights (norm weights around 1 so the q/k norms matter)."
    config = Qwen3Config(**(BASE | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = HFQwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.1)
    return hf


def save_hf(tmp_path: Path, name: str, hf, **save_kw) -> Path:
    folder = tmp_path / name
    hf.save_pretrained(folder, **save_kw)
    return folder


def load_ours(folder: Path) -> Qwen3ForCausalLM:
    return load_model(Qwen3ForCausalLM(load_config(folder)), folder, QWEN3_PACKED_WEIGHTS).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_random_qwen3_matches_transformers(tmp_path, name):
    hf = make_hf(**CONFIGS[name])
    folder = save_hf(tmp_path, name, hf)
    names = set(load_file(folder / "model.safetensors"))
    assert ("lm_head.weight" in names) == (not hf.config.tie_word_embeddings)  # the tied checkpoint has no lm_head
    model = load_ours(folder)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    seqs = random_seqs(hf.config.vocab_size, [7, 1, 12, 3])
    ours, theirs = our_logits(model, seqs), hf_logits(hf, seqs)
    assert rel_err(ours, theirs) < RTOL


def test_bfloat16_checkpoint_loads_into_a_float32_model(tmp_path):
    folder = save_hf(tmp_path, "bf16", make_hf().to(torch.bfloat16))
    assert load_file(folder / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    model = load_ours(folder)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    seqs = random_seqs(131, [9, 4])
    assert rel_err(our_logits(model, seqs), hf_logits(hf, seqs)) < RTOL


def test_checkpoint_split_over_several_files(tmp_path):
    hf = make_hf(**CONFIGS["mha_untied"])
    folder = save_hf(tmp_path, "sharded", hf, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    seqs = random_seqs(131, [5, 6])
    assert rel_err(our_logits(load_ours(folder), seqs), hf_logits(hf, seqs)) < RTOL


def test_old_style_config_with_top_level_rope_theta(tmp_path):
    hf = make_hf(rope_parameters={"rope_type": "default", "rope_theta": 50_000.0})
    folder = save_hf(tmp_path, "old", hf)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=50_000.0, rope_scaling=None)  # how transformers 4 wrote Qwen3 configs
    (folder / "config.json").write_text(json.dumps(raw))
    model = load_ours(folder)
    assert model.model.layers[0].self_attn.rotary_emb.base == 50_000.0
    seqs = random_seqs(131, [11, 2])
    assert rel_err(our_logits(model, seqs), hf_logits(hf, seqs)) < RTOL


def test_tied_checkpoint_that_stores_lm_head_anyway(tmp_path):
    hf = make_hf()
    folder = save_hf(tmp_path, "tied", hf)
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, folder / "model.safetensors")
    model = load_ours(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seqs = random_seqs(131, [6])
    assert rel_err(our_logits(model, seqs), hf_logits(hf, seqs)) < RTOL


def test_without_metadata_all_tokens_are_one_sequence(tmp_path):
    hf = make_hf()
    model = load_ours(save_hf(tmp_path, "one", hf))
    ids = random_seqs(131, [8])[0]
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(8)))
    assert rel_err(logits, hf_logits(hf, [ids])) < RTOL


def test_compute_logits_on_selected_rows(tmp_path):
    hf = make_hf()
    model = load_ours(save_hf(tmp_path, "rows", hf))
    seqs = random_seqs(131, [4, 6, 2])
    lens = [4, 6, 2]
    with torch.no_grad():
        hidden = model(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), prefill_meta(lens))
        last_rows = torch.tensor([3, 9, 11])  # the last token of each sequence: what the runner samples from
        logits = model.compute_logits(hidden[last_rows])
    assert logits.shape == (3, 131)
    want = torch.stack([hf_logits(hf, [s])[-1] for s in seqs])
    assert rel_err(logits, want) < RTOL


# ---------------------------------------------------------------- the embedded tiny model


@pytest.fixture(scope="module")
def tiny():
    hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32).eval()
    return load_ours(Path(TINY_MODEL_PATH)), hf, AutoTokenizer.from_pretrained(TINY_MODEL_PATH)


def test_tiny_model_matches_transformers(tiny):
    model, hf, tokenizer = tiny
    texts = ["def fibonacci(n):\n    ", "import os\n", "x", "class Foo(Bar):\n    def __init__(self):\n"]
    seqs = [torch.tensor(tokenizer.encode(t)) for t in texts]
    ours, theirs = our_logits(model, seqs), hf_logits(hf, seqs)
    assert rel_err(ours, theirs) < RTOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def kv_step(model, chunks: list[tuple[torch.Tensor, int, list[int]]], block_size: int) -> torch.Tensor:
    "One engine step: each chunk is (new token ids, tokens already cached, block table); returns every row's logits."
    ids, positions, slots, q_lens, kv_lens = [], [], [], [], []
    for tokens, start, table in chunks:
        pos = torch.arange(start, start + len(tokens))
        ids.append(tokens), positions.append(pos)
        slots += [table[p // block_size] * block_size + p % block_size for p in pos.tolist()]
        q_lens.append(len(tokens)), kv_lens.append(start + len(tokens))
    width = max(len(t) for _, _, t in chunks)
    tables = torch.tensor([t + [-1] * (width - len(t)) for _, _, t in chunks], dtype=torch.int32)
    cumsum = lambda xs: torch.tensor([0] + xs).cumsum(0).to(torch.int32)  # noqa: E731
    meta = AttentionMetadata(
        cu_seqlens_q=cumsum(q_lens),
        cu_seqlens_k=cumsum(kv_lens),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens),
        slot_mapping=torch.tensor(slots),
        context_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=tables,
    )
    assert meta.is_decode_only == all(n == 1 for n in q_lens)
    with torch.no_grad():
        return model.compute_logits(model(torch.cat(ids), torch.cat(positions), meta))


def test_chunked_prefill_and_decode_through_the_paged_kv_cache(tiny):
    "Prefill in chunks, then decode, with K/V in a paged cache: every step's logits match transformers' full pass."
    model, hf, tokenizer = tiny
    cfg = model.config
    block_size, num_blocks = 4, 16
    for module in model.modules():
        if isinstance(module, Attention):
            module.k_cache = torch.zeros(num_blocks, block_size, module.num_kv_heads, module.head_dim)
            module.v_cache = torch.zeros_like(module.k_cache)
    try:
        a = torch.tensor(tokenizer.encode("def fibonacci(n):\n    if n < 2:\n"))[:13]
        b = torch.tensor(tokenizer.encode("import os\nimport sys\nimport json\n"))[:10]
        assert (len(a), len(b)) == (13, 10)  # every step below has new tokens for both sequences
        table_a, table_b = [3, 7, 1, 9], [0, 5, 2]  # 4 blocks of 4 for 13 tokens, 3 for 10, scattered
        full_a, full_b = hf_logits(hf, [a])[: len(a)], hf_logits(hf, [b])[: len(b)]
        steps = [  # (a's new tokens from .. to, b's new tokens from .. to)
            ((0, 6), (0, 7)),  # a: first prefill chunk, b: whole prompt
            ((6, 10), (7, 8)),  # a: rest of its prompt, b: a decode token (a mixed step)
            ((10, 11), (8, 9)),  # decode only
            ((11, 13), (9, 10)),  # a: 2 tokens at once (e.g. speculative), b: decode
        ]
        for (a0, a1), (b0, b1) in steps:
            logits = kv_step(model, [(a[a0:a1], a0, table_a), (b[b0:b1], b0, table_b)], block_size)
            want = torch.cat([full_a[a0:a1], full_b[b0:b1]])
            assert rel_err(logits, want) < RTOL, (a0, a1, b0, b1)
    finally:
        for module in model.modules():
            if isinstance(module, Attention):
                module.k_cache = module.v_cache = None  # the module-scoped model is shared: back to no cache
    assert cfg.num_hidden_layers == len(model.model.layers)


# ---------------------------------------------------------------- loader errors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    "A small untied Qwen3 folder and its tensors, to break in various ways."
    folder = tmp_path_factory.mktemp("ckpt")
    make_hf(**CONFIGS["mha_untied"]).save_pretrained(folder)
    return folder, load_file(folder / "model.safetensors")


def broken(tmp_path: Path, checkpoint, files: dict[str, dict | bytes] | None = None) -> Path:
    "A copy of the checkpoint folder's config with these safetensors files (tensors, or raw bytes)."
    folder = tmp_path / "broken"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    for name, content in (files or {}).items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            save_file(content, folder / name)
    return folder


def expect_load_error(folder: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(Qwen3ForCausalLM(load_config(folder)), folder, QWEN3_PACKED_WEIGHTS)


def test_missing_tensor_is_named(tmp_path, checkpoint):
    tensors = {k: v for k, v in checkpoint[1].items() if k != "model.layers.1.self_attn.k_proj.weight"}
    expect_load_error(
        broken(tmp_path, checkpoint, {"model.safetensors": tensors}),
        r"missing 1 tensor\(s\) .*: model\.layers\.1\.self_attn\.k_proj\.weight$",
    )


def test_missing_lm_head_of_an_untied_model_is_named(tmp_path, checkpoint):
    tensors = {k: v for k, v in checkpoint[1].items() if k not in ("lm_head.weight", "model.norm.weight")}
    expect_load_error(
        broken(tmp_path, checkpoint, {"model.safetensors": tensors}),
        r"missing 2 tensor\(s\) .*: lm_head\.weight, model\.norm\.weight$",
    )


def test_many_missing_tensors_are_summarized(tmp_path, checkpoint):
    tensors = {"model.norm.weight": checkpoint[1]["model.norm.weight"]}
    n = len(checkpoint[1]) - 1
    expect_load_error(
        broken(tmp_path, checkpoint, {"model.safetensors": tensors}), rf"missing {n} tensor\(s\).* and {n - 8} more$"
    )


def test_unexpected_tensor_is_named(tmp_path, checkpoint):
    tensors = checkpoint[1] | {"model.layers.0.self_attn.rel_pos.weight": torch.zeros(3)}
    expect_load_error(
        broken(tmp_path, checkpoint, {"model.safetensors": tensors}),
        "unexpected tensor model.layers.0.self_attn.rel_pos.weight",
    )


def test_mis_shaped_tensors_are_named_with_both_shapes(tmp_path, checkpoint):
    cases = {
        "model.layers.0.self_attn.q_proj.weight": (torch.zeros(47, 48), r"\[48, 48\], found \[47, 48\]"),
        "model.layers.1.mlp.down_proj.weight": (torch.zeros(48, 81), r"\[48, 80\], found \[48, 81\]"),
        "model.norm.weight": (torch.zeros(49), r"\[48\], found \[49\]"),
        "model.embed_tokens.weight": (torch.zeros(130, 48), r"\[131, 48\], found \[130, 48\]"),
    }
    for i, (name, (tensor, shapes)) in enumerate(cases.items()):
        folder = broken(tmp_path / str(i), checkpoint, {"model.safetensors": checkpoint[1] | {name: tensor}})
        expect_load_error(folder, f"tensor {name}: expected shape {shapes}")


def test_tensor_in_two_files_is_an_error(tmp_path, checkpoint):
    tensors = checkpoint[1]
    extra = {"model.norm.weight": tensors["model.norm.weight"]}
    expect_load_error(
        broken(tmp_path, checkpoint, {"a.safetensors": tensors, "b.safetensors": extra}),
        "model.norm.weight appears twice",
    )


@pytest.mark.parametrize("cut", [0.5, 0.999, 0.0])
def test_truncated_safetensors_file_is_named(tmp_path, checkpoint, cut):
    data = (checkpoint[0] / "model.safetensors").read_bytes()
    folder = broken(tmp_path, checkpoint, {"model-00001-of-00001.safetensors": data[: int(len(data) * cut)]})
    expect_load_error(folder, "cannot read model-00001-of-00001.safetensors")


def test_garbage_safetensors_file_is_named(tmp_path, checkpoint):
    folder = broken(tmp_path, checkpoint, {"model.safetensors": b"this is not a safetensors file at all"})
    expect_load_error(folder, "cannot read model.safetensors")


def test_folder_without_safetensors(tmp_path, checkpoint):
    folder = broken(tmp_path, checkpoint)
    (folder / "pytorch_model.bin").write_bytes(b"")
    expect_load_error(folder, r"no \*\.safetensors files")


def test_load_config_accepts_only_registered_families(tmp_path, checkpoint):
    assert load_config(checkpoint[0]).model_type == "qwen3"
    with pytest.raises(ValueError, match="is not a folder"):
        load_config(tmp_path / "nope")
    with pytest.raises(ValueError, match="has no config.json"):
        load_config(tmp_path)
    for i, (text, match) in enumerate(
        [
            ('{"model_type": "mamba"}', "type 'mamba'; minivllm runs qwen3, qwen2"),
            ('{"hidden_size": 4}', "type None"),
            ("{not json", "not a JSON object"),
            ("[1, 2]", "not a JSON object"),
        ]
    ):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            load_config(folder)


def test_load_weights_from_any_named_tensors():
    hf = make_hf()
    model = load_weights(Qwen3ForCausalLM(hf.config), hf.state_dict().items(), QWEN3_PACKED_WEIGHTS)
    seqs = random_seqs(131, [5])
    assert rel_err(our_logits(model.eval(), seqs), hf_logits(hf, seqs)) < RTOL


# ---------------------------------------------------------------- the model registry


def test_registry_spec_of_a_qwen3_config():
    cfg = load_config(TINY_MODEL_PATH)
    spec = model_spec(cfg)
    assert isinstance(spec, ModelSpec) and spec is MODEL_REGISTRY["qwen3"]
    assert spec.model_class is Qwen3ForCausalLM and spec.packed_weights is QWEN3_PACKED_WEIGHTS
    assert spec.weight_mapping(cfg) == QWEN3_PACKED_WEIGHTS  # nothing that depends on the config (no experts)


def test_load_config_refuses_a_type_the_registry_does_not_know(tmp_path):
    assert "mistral" not in MODEL_REGISTRY
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    known = ", ".join(MODEL_REGISTRY)  # the message names every type the registry knows
    with pytest.raises(ValueError, match=re.escape(f"type 'mistral'; minivllm runs {known} models")):
        load_config(tmp_path)


def test_build_model_equals_loading_by_hand():
    cfg = load_config(TINY_MODEL_PATH)
    built = build_model(cfg, TINY_MODEL_PATH, torch.float32, torch.device("cpu"))
    by_hand = load_model(Qwen3ForCausalLM(cfg), TINY_MODEL_PATH, QWEN3_PACKED_WEIGHTS).eval()
    assert type(built) is Qwen3ForCausalLM and not built.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in built.parameters())
    seqs = random_seqs(cfg.vocab_size, [7, 1, 5])
    assert torch.equal(our_logits(built, seqs), our_logits(by_hand, seqs))


def test_build_model_makes_the_parameters_in_the_dtype_asked_for():
    default = torch.get_default_dtype()
    model = build_model(load_config(TINY_MODEL_PATH), TINY_MODEL_PATH, torch.bfloat16, torch.device("cpu"))
    assert torch.get_default_dtype() == default  # restored
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32  # the angles stay float32


# ---------------------------------------------------------------- one rotary embedding per model


def test_one_rotary_embedding_per_model_shared_by_its_layers():
    config = Qwen3Config(**(BASE | dict(num_hidden_layers=3)))
    a, b = Qwen3ForCausalLM(config), Qwen3ForCausalLM(config)
    rope = a.model.layers[0].self_attn.rotary_emb
    assert isinstance(rope, RotaryEmbedding)
    assert all(layer.self_attn.rotary_emb is rope for layer in a.model.layers)
    assert b.model.layers[0].self_attn.rotary_emb is not rope  # two models (two engines) share no state
    assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.shape == (256, 32)
    # a non-persistent buffer: one for the whole model, not in the state dict (nor in checkpoints)
    assert [name for name, _ in a.named_buffers()] == ["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]
    assert not any("cos_sin_cache" in name for name in a.state_dict())
    # it moves with the model's .to(), still shared; the other model's stays where it was
    a.to("meta")
    assert all(layer.self_attn.rotary_emb is rope for layer in a.model.layers)
    assert rope.cos_sin_cache.device.type == "meta"
    assert b.model.layers[0].self_attn.rotary_emb.cos_sin_cache.device.type == "cpu"
    # and it is made on the device the model is built on
    with torch.device("meta"):
        c = Qwen3ForCausalLM(config)
    assert c.model.layers[2].self_attn.rotary_emb.cos_sin_cache.device.type == "meta"


# ---------------------------------------------------------------- unsupported configs and bad input


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding-window"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e6,
                    "original_max_position_embeddings": 64,
                }
            ),
            "rope scaling type 'yarn'",
        ),
        (dict(num_attention_heads=3, num_key_value_heads=2, head_dim=16), "multiple of num_key_value_heads"),
    ],
)
def test_unsupported_configs_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        Qwen3ForCausalLM(Qwen3Config(**(BASE | overrides)))


def test_packed_weights_mapping():
    assert QWEN3_PACKED_WEIGHTS == {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }


# ---------------------------------------------------------------- tensor parallel: 2 processes, shards cut at load


@pytest.mark.timeout(300)
def test_tensor_parallel_model_matches_hf(tmp_path, rank_pool):
    """TP=2 over gloo: each rank loads its shards from the full checkpoint (Qwen3, Qwen3-MoE); the logits match
    transformers."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=131,
            hidden_size=32,
            intermediate_size=48,
            head_dim=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    folders = [
        str(save_hf(tmp_path, "gqa", make_hf(**CONFIGS["gqa4_three_layers"]))),
        str(save_hf(tmp_path, "mqa", make_hf(**CONFIGS["mqa_narrow_bias"]))),  # 1 KV head: replicated
        str(save_hf(tmp_path, "moe", moe.eval())),
    ]  # experts cut in two
    # (the processes are the session's shared pair, tests/_rank_pool.py: each rank runs _qwen3_tp_worker.run)
    assert rank_pool.run("_qwen3_tp_worker", "run", 2, free_port(), folders) == {0: None, 1: None}


# ---------------------------------------------------------------- GPU: Qwen3-0.6B's dimensions

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def qwen3_06b_random(tmp_path_factory):
    "transformers' Qwen3 with Qwen3-0.6B's dimensions and its own seeded random init, on CUDA, saved to a folder."
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_06B)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        hf = HFQwen3ForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("qwen3-0.6b-random")
    hf.save_pretrained(folder)
    return folder, hf


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qwen3_06b_dimensions_on_gpu_match_transformers(qwen3_06b_random, monkeypatch, backend):
    "Qwen3-0.6B's architecture (28 layers, random weights), float32 on CUDA, through the normal loader."
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    folder, hf = qwen3_06b_random
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(load_config(folder))
    load_model(model, folder, QWEN3_PACKED_WEIGHTS).eval()
    apply_policy(model, kernel_policy("cuda", torch.float32, backend, "torch"))  # as the engine does, once
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.is_cuda
    seqs = random_seqs(hf.config.vocab_size, [37, 1, 129, 64, 5])
    ours, theirs = our_logits(model, seqs), hf_logits(hf, seqs)
    assert ours.is_cuda and ours.dtype == torch.float32
    assert rel_err(ours, theirs) < RTOL
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.99
