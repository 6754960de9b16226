from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..layers.linear import check_shape


def safetensors_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    "Every `(name, tensor)` of every `*.safetensors` file in the folder `path` (on the CPU, in the file's dtype)."
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"cannot read {file.name}: it is not a complete safetensors file ({e})") from e

# %%
def packed_name(name: str, mapping: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    "`(parameter name, shard id)` for a checkpoint tensor name: `...q_proj.weight` -> `(...qkv_proj.weight, 'q')`."
    for part, (packed, shard_id) in mapping.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{packed}.", 1), shard_id
    return name, None


def checkpoint_names(param_name: str, mapping: dict[str, tuple[str, str | int]]) -> dict[str | int | None, str]:
    "The checkpoint tensor(s) a parameter is loaded from, by shard id (`{None: name}` for an unpacked parameter)."
    names = {shard_id: param_name.replace(f".{packed}.", f".{part}.", 1)
             for part, (packed, shard_id) in mapping.items() if f".{packed}." in param_name}
    return names or {None: param_name}

# %%
def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    "Copy a whole tensor into a parameter without a loader of its own (norm weights)."
    if shard_id is not None:
        raise ValueError(f"this parameter has no packed shards, got shard_id {shard_id!r}")
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 mapping: dict[str, tuple[str, str | int]]) -> nn.Module:
    "Load checkpoint tensors through each parameter's `weight_loader` (`mapping`: the packed ones); all must fit."
    params = dict(model.named_parameters())
    tied_aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    expected = {(p, shard): ckpt for p in params for shard, ckpt in checkpoint_names(p, mapping).items()}
    loaded: set[tuple[str, str | int | None]] = set()
    for name, tensor in weights:
        if name in tied_aliases or name.endswith("rotary_emb.inv_freq"):
            continue
        param_name, shard_id = packed_name(name, mapping)
        if param_name not in params:
            mapped = f" (packed into {param_name})" if param_name != name else ""
            raise ValueError(f"unexpected tensor {name} in the checkpoint: {type(model).__name__} has no such "
                             f"parameter{mapped}")
        if (param_name, shard_id) in loaded:
            raise ValueError(f"tensor {name} appears twice in the checkpoint")
        param = params[param_name]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor) if shard_id is None else weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"tensor {name}: {e}") from e
        loaded.add((param_name, shard_id))
    missing = sorted(expected[key] for key in expected.keys() - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"the checkpoint is missing {len(missing)} tensor(s) the model needs: {shown}")
    return model


def load_model(model: nn.Module, path: str | Path, mapping: dict[str, tuple[str, str | int]]) -> nn.Module:
    return load_weights(model, safetensors_weights(path), mapping)
