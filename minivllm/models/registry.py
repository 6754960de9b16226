from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from ..distributed.parallel_state import SINGLE, TPGroup
from .loader import load_model
from .qwen3 import QWEN3_PACKED_WEIGHTS, Qwen3ForCausalLM


@dataclass(frozen=True)
class ModelSpec:
    "How to run one model family: its module, and which checkpoint tensors it packs into one parameter."
    model_class: type[nn.Module]                       # built as model_class(hf_config, tp)
    packed_weights: dict[str, tuple[str, str | int]]   # checkpoint name part -> (our parameter, shard id)


MODEL_REGISTRY: dict[str, ModelSpec] = {   # Hugging Face `model_type` -> its spec: a new family is one more line
    "qwen3": ModelSpec(Qwen3ForCausalLM, QWEN3_PACKED_WEIGHTS),
}


def model_spec(hf_config: PretrainedConfig) -> ModelSpec:
    return MODEL_REGISTRY[hf_config.model_type]

# %%
def load_config(path: str | Path) -> PretrainedConfig:
    "The Hugging Face config of the model folder `path`; a ValueError unless the registry knows its model type."
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(path)!r} has no config.json: not a Hugging Face model folder")
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"config.json in {str(path)!r} is not a JSON object: {e}") from e
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"{str(path)!r} holds a model of type {model_type!r}; minivllm runs "
                         f"{', '.join(MODEL_REGISTRY)} models")
    return AutoConfig.from_pretrained(folder, local_files_only=True)

# %%
def build_model(hf_config: PretrainedConfig, path: str | Path, dtype: torch.dtype, device: torch.device,
                tp: TPGroup = SINGLE) -> nn.Module:
    "The model of `hf_config`'s family, this rank's shard, made in `dtype` on `device` and filled from `path`."
    spec, default_dtype = model_spec(hf_config), torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # the parameters are made in `dtype` (restored at once)
    try:
        with torch.device(device):
            model = spec.model_class(hf_config, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    return load_model(model, path, spec.packed_weights).eval()
