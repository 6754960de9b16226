"""The request and what runs (notebook 09, project issue 47): `EngineArgs` is checked data that reads no file;
`resolve()` does the I/O once and returns a frozen `EngineConfig`; `Config` still works for one release, with a
warning; the scheduler's options go by name."""

import dataclasses
import json
import shutil
import typing
import warnings

import pytest
import torch

from minivllm import TINY_MODEL_PATH, EngineArgs
from minivllm.config import EngineConfig
from minivllm.engine.scheduler import Scheduler


def test_a_request_is_checked_data_that_reads_no_file():
    "Made, compared and varied without a model folder: the checks that need one wait for resolve()."
    args = EngineArgs("/no/such/folder", device="cpu", max_model_len=128)
    assert args == EngineArgs.from_kwargs("/no/such/folder", device="cpu", max_model_len=128)
    assert dataclasses.replace(args, max_num_seqs=8) != args
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_num_seqs = 8
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        dataclasses.replace(args, block_size=12)
    with pytest.raises(ValueError, match="model path '/no/such/folder' is not a folder"):
        args.resolve()


def test_resolve_gives_a_frozen_config_of_decisions(tmp_path):
    "Every field declared and decided; generation_config.json read once, so a later edit of the file changes nothing."
    folder = tmp_path / "model"
    shutil.copytree(TINY_MODEL_PATH, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "temperature": 0.6}))
    config = EngineArgs(str(folder), device="cpu", attention_backend="torch").resolve()
    hints = typing.get_type_hints(EngineConfig)
    assert {f.name for f in dataclasses.fields(EngineConfig)} == set(hints)
    assert (config.device, config.dtype, config.cache_dtype) == ("cpu", torch.float32, torch.float32)
    assert (config.decode_backend, config.prefill_backend, config.attention_backend) == ("torch",) * 3
    assert config.torch_dtype is config.dtype and config.max_model_len == min(
        4096, config.hf_config.max_position_embeddings
    )
    assert config.eos_token_ids == (0, 2) and config.default_sampling_params == {"temperature": 0.6}
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.1}))
    assert config.default_sampling_params == {"temperature": 0.6}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 8


def test_config_is_deprecated_and_resolves():
    with pytest.warns(DeprecationWarning, match="EngineArgs"):
        from minivllm.config import Config

        config = Config(TINY_MODEL_PATH, device="cpu", max_model_len=64)
    assert config == EngineArgs(TINY_MODEL_PATH, device="cpu", max_model_len=64).resolve()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineArgs(TINY_MODEL_PATH, device="cpu").resolve()  # the new way warns of nothing


def test_the_schedulers_options_go_by_name():
    limits = dict(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)
    assert not Scheduler(**limits, enable_chunked_prefill=False).enable_chunked_prefill
    with pytest.raises(TypeError):
        Scheduler(*limits.values(), None, False)


def test_max_num_seqs_defaults_as_vllm_by_device(monkeypatch):
    "Unset: 1,024 on a GPU of 70 GiB or more that is not an A100, else 256 (the CPU too); never above the budget."
    from minivllm.engine_args import default_max_num_seqs

    assert EngineArgs(TINY_MODEL_PATH, device="cpu").resolve().max_num_seqs == 256
    assert EngineArgs(TINY_MODEL_PATH, device="cpu", max_num_batched_tokens=100).resolve().max_num_seqs == 100
    assert EngineArgs(TINY_MODEL_PATH, device="cpu", max_num_seqs=8).resolve().max_num_seqs == 8
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, gib, want in (
        ("NVIDIA H100 80GB HBM3", 79.2, 1024),
        ("NVIDIA H200", 139.8, 1024),
        ("NVIDIA A100-SXM4-80GB", 79.2, 256),
        ("NVIDIA L4", 22.0, 256),
    ):
        props = type("Props", (), {"name": name, "total_memory": int(gib * 2**30)})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, props=props: props)
        assert default_max_num_seqs("cuda", 16384) == want, name
        assert default_max_num_seqs("cuda", 512) == min(want, 512), name
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 1"):
        EngineArgs(TINY_MODEL_PATH, max_num_batched_tokens=0)


def test_kv_cache_memory_bytes_fixes_the_budget_in_bytes():
    "vLLM's kv_cache_memory_bytes: the cache gets that (to the block); an 8-bit cache holds twice the blocks."
    from minivllm import LLM, SamplingParams
    from minivllm.engine.kv_cache import kv_block_bytes

    budget, blocks, tokens = 64 * 2**20, {}, {}
    for kv_dtype in ("auto", "fp8"):
        kwargs = dict(dtype="bfloat16", kv_cache_dtype=kv_dtype, max_model_len=256, skip_tokenizer_init=True)
        with LLM(TINY_MODEL_PATH, device="cpu", kv_cache_memory_bytes=budget, **kwargs) as llm:
            runner = llm.llm_engine.executor.runner
            block = kv_block_bytes(runner.config.hf_config, 16, runner.config.cache_dtype)
            assert budget - block < runner.kv_cache.nbytes <= budget
            blocks[kv_dtype] = runner.num_blocks
            out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0))
            tokens[kv_dtype] = out[0].outputs[0].token_ids
    assert blocks["fp8"] == 2 * blocks["auto"] == 1024 and len(tokens["fp8"]) == 4
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be at least 1"):
        EngineArgs(TINY_MODEL_PATH, kv_cache_memory_bytes=0)
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(TINY_MODEL_PATH, kv_cache_memory_bytes=budget, num_kvcache_blocks=8)
    with pytest.raises(TypeError, match="kv_cache_memory_bytes must be an int"):
        EngineArgs(TINY_MODEL_PATH, kv_cache_memory_bytes=2.5e9)


def test_serve_passes_the_kv_cache_flags_to_the_engine():
    pytest.importorskip("fastapi")
    from minivllm.entrypoints.cli import engine_kwargs, parse_serve_args

    args = parse_serve_args([TINY_MODEL_PATH, "--kv-cache-memory-bytes", str(2**30), "--kv-cache-dtype", "fp8"])
    kwargs = engine_kwargs(args)
    assert (kwargs["kv_cache_memory_bytes"], kwargs["kv_cache_dtype"]) == (2**30, "fp8")
    assert EngineArgs.from_kwargs(TINY_MODEL_PATH, **kwargs).kv_cache_memory_bytes == 2**30
    assert "kv_cache_memory_bytes" not in engine_kwargs(parse_serve_args([TINY_MODEL_PATH]))
