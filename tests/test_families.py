"""Model families through the registry (notebook 08, section 5): Qwen2/Qwen2.5, Llama 3 (with its rotary scaling) and
Qwen3-MoE. For each, small random configs: logits against transformers in float32 (1e-4 relative) and greedy tokens
equal to transformers' `generate` through `LLM`, on the CPU; on the GPU, the same greedy parity under CUDA graphs.
Also: the experts' tensor-parallel shards, dummy weights (load_format="dummy"), and the error for an unknown family."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

from minivllm import LLM, SamplingParams
from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels.fused_moe import moe_experts_reference
from minivllm.layers.attention import AttentionMetadata
from minivllm.layers.moe import FusedMoE
from minivllm.models.registry import MODEL_REGISTRY, build_model, load_config

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = {
    "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen2.5 untied, head_dim 32": lambda: Qwen2Config(
        **{**SMALL, "num_attention_heads": 2}, tie_word_embeddings=False
    ),
    "llama3 rope scaling, untied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False, rope_parameters=LLAMA3),
    "llama biases, mha": lambda: LlamaConfig(
        **{**SMALL, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "qwen3_moe sparse step 2, dense layer, no renorm": lambda: Qwen3MoeConfig(
        **SMALL,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[2],
        tie_word_embeddings=True,
    ),
}


def make_folder(config, folder, seed: int = 0):
    "A random transformers model of `config` (biases too) saved in `folder`; returns the float32 model."
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(re.sub(r"\W+", "_", request.param))
    return request.param, folder, make_folder(FAMILIES[request.param](), folder)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 11, 70)]


def hf_greedy(hf, ids: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in ids:
        x = torch.tensor([p], device=hf.device)
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(y[0, len(p) :].tolist())
    return out


def test_logits_match_transformers(family):
    name, folder, hf = family
    config = load_config(folder)
    model = build_model(config, folder, torch.float32, torch.device("cpu"))
    assert type(model) is MODEL_REGISTRY[config.model_type].model_class
    seqs = prompts(config.vocab_size)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(cu, cu, max(map(len, seqs)), max(map(len, seqs)))
    with torch.no_grad():
        ours = model.compute_logits(
            model(torch.tensor(sum(seqs, [])), torch.cat([torch.arange(len(s)) for s in seqs]), meta)
        )
        theirs = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4, name


def test_greedy_tokens_match_transformers_generate(family):
    name, folder, hf = family
    ids = prompts(hf.config.vocab_size)
    with LLM(str(folder), skip_tokenizer_init=True, max_model_len=256, block_size=8) as llm:
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, ids, 10), name


def test_family_specifics_are_built():
    llama = build_model(
        LlamaConfig(**SMALL, rope_parameters=LLAMA3), None, torch.float32, torch.device("cpu"), load_format="dummy"
    )
    attn = llama.model.layers[0].self_attn
    assert not attn.qk_norm and not hasattr(attn, "q_norm") and attn.rotary_emb.rope_scaling["rope_type"] == "llama3"
    qwen2 = build_model(Qwen2Config(**SMALL), None, torch.float32, torch.device("cpu"), load_format="dummy")
    attn = qwen2.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and not attn.qk_norm
    moe = build_model(
        FAMILIES["qwen3_moe sparse step 2, dense layer, no renorm"](),
        None,
        torch.float32,
        torch.device("cpu"),
        load_format="dummy",
    )
    kinds = [type(layer.mlp).__name__ for layer in moe.model.layers]
    assert kinds == ["Qwen3MLP", "Qwen3MoeSparseMoeBlock", "Qwen3MLP"]  # step 2: layer 1; layer 2 is mlp-only


def test_experts_are_sharded_like_the_dense_mlp():
    E, H, inter = 4, 16, 8
    g = torch.Generator().manual_seed(0)
    parts = {
        (e, p): torch.randn((H, inter) if p == "down_proj" else (inter, H), generator=g)
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
    }

    def loaded(tp):
        m = FusedMoE(E, H, inter, tp=tp)
        for (e, p), t in parts.items():
            param = m.w2_weight if p == "down_proj" else m.w13_weight
            param.weight_loader(param, t, (e, p))
        return m

    whole, ranks = loaded(TPGroup(0, 1)), [loaded(TPGroup(r, 2)) for r in range(2)]
    for e in range(E):
        gate = torch.cat([r.w13_weight[e, : inter // 2] for r in ranks])
        up = torch.cat([r.w13_weight[e, inter // 2 :] for r in ranks])
        assert torch.equal(torch.cat([gate, up]), whole.w13_weight[e])
        assert torch.equal(torch.cat([r.w2_weight[e] for r in ranks], 1), whole.w2_weight[e])
    x, ids = torch.randn(5, H, generator=g), torch.randint(0, E, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    summed = sum(moe_experts_reference(x, r.w13_weight, r.w2_weight, w, ids) for r in ranks)  # the all-reduce's sum
    torch.testing.assert_close(summed, whole(x, w, ids), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expected shape"):
        whole.w13_weight.weight_loader(whole.w13_weight, torch.zeros(inter + 1, H), (0, "up_proj"))
    with pytest.raises(ValueError, match="no expert part"):
        whole.w13_weight.weight_loader(whole.w13_weight, torch.zeros(inter, H), (E, "up_proj"))


def test_dummy_weights_need_only_a_config_and_are_seeded(tmp_path):
    config = FAMILIES["qwen3_moe"]()
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    a = build_model(load_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), load_format="dummy", seed=1)
    b = build_model(load_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), load_format="dummy", seed=1)
    c = build_model(load_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), load_format="dummy", seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.layers[0].mlp.experts.w13_weight, c.model.layers[0].mlp.experts.w13_weight)
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
    with LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=128) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="load_format must be 'auto' or 'dummy'"):
        LLM(str(tmp_path), load_format="npz")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_dummy_weights_are_a_random_checkpoint_loaded(name, tmp_path):
    """load_format='dummy' equals writing dummy_checkpoint's tensors to disk and loading them, on every rank of TP=2;
    and transformers loads that checkpoint with no tensor missing or left over."""
    from safetensors.torch import save_file

    from minivllm.models.loader import dummy_checkpoint
    from minivllm.models.registry import model_spec

    config = FAMILIES[name]()
    config.save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    spec = model_spec(cfg)
    save_file(
        dict(dummy_checkpoint(spec.model_class(cfg, TPGroup()), spec.weight_mapping(cfg), seed=5)),
        tmp_path / "model.safetensors",
    )
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for tp in (TPGroup(), TPGroup(0, 2), TPGroup(1, 2)):
        dummy = build_model(cfg, tmp_path, torch.float32, torch.device("cpu"), tp, load_format="dummy", seed=5)
        loaded = build_model(cfg, tmp_path, torch.float32, torch.device("cpu"), tp)
        for (key, a), b in zip(dummy.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(a, b), (tp, key)


def test_unknown_family_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ValueError, match=re.escape("type 'mamba'; minivllm runs qwen3, qwen2, llama, qwen3_moe")):
        load_config(tmp_path)


# ---- on a GPU: float32 greedy parity under CUDA graphs ------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_greedy_parity_under_cuda_graphs(family):
    name, folder, hf = family
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = prompts(hf.config.vocab_size)
    reference = hf_greedy(hf.cuda(), ids, 32)
    hf.cpu()
    with LLM(
        str(folder),
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        gpu_memory_utilization=0.3,
    ) as llm:
        assert llm.llm_engine.executor.runner.graphs is not None  # CUDA graphs were captured
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = llm.generate(ids, greedy, use_tqdm=False)
        alone = llm.generate(ids[:1], greedy, use_tqdm=False)  # one sequence: the one-row path (norm_gemv)
    assert [o.outputs[0].token_ids for o in outs] == reference, name
    assert alone[0].outputs[0].token_ids == reference[0], name
