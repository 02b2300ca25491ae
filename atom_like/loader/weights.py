"""Checkpoint loading: HF folders with one or many safetensors files.

Each model declares a WeightMap (prefix renames, checkpoint projections packed into merged
parameters, tensors to skip with the reason logged once); this module does the rest and
refuses to start on a missing, unexpected or mis-shaped tensor, naming it and both shapes.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from model_ops.linear import MergedLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightMap:
    # (checkpoint prefix, parameter prefix), first match wins: e.g. Kimi's "language_model.model." -> "model."
    prefix_renames: tuple[tuple[str, str], ...] = ()
    # checkpoint module name -> (merged module name, shard): "q_proj" -> ("qkv_proj", 0)
    packed: dict[str, tuple[str, int]] = field(default_factory=dict)
    # (checkpoint prefix or substring, why it is skipped), logged once per reason
    skip: tuple[tuple[str, str], ...] = ()
    # parameters a checkpoint may leave out (an EAGLE3 draft without embed_tokens borrows the target's)
    optional: tuple[str, ...] = ()


def safetensors_files(folder: str) -> list[str]:
    """The shard files of a checkpoint, via model.safetensors.index.json when present."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    files = [os.path.join(folder, n) for n in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise ValueError(f"checkpoint {folder!r} has no weight file" + (f": missing {missing}" if missing else " (*.safetensors)"))
    return files


def iter_checkpoint(folder: str, desc: str = "Loading weights") -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(folder)
    for path in tqdm(files, desc=desc, unit="shard", disable=len(files) < 2):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_keys(folder: str) -> set[str]:
    """Tensor names of a checkpoint, read from the file headers only."""
    keys: set[str] = set()
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            keys.update(f.keys())
    return keys


def convert_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Seed 004's rule: same-width float formats are bit-compatible encodings (fp8 variants) and
    are viewed; fp16 <-> bf16 have the same width but different ranges, so they are converted by
    value, as is every other pair."""
    if tensor.dtype == dtype:
        return tensor
    same_width = tensor.element_size() == torch.empty((), dtype=dtype).element_size()
    if same_width and tensor.is_floating_point() and dtype.is_floating_point and {tensor.dtype, dtype} != {torch.float16, torch.bfloat16}:
        return tensor.view(dtype)
    return tensor.to(dtype)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], weight_map: WeightMap) -> list[str]:
    """Load every parameter of `model`; returns the optional ones the checkpoint lacked."""
    params = dict(model.named_parameters())
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, MergedLinear):
            expected.update((name, shard) for shard in range(len(module.output_sizes)))
        else:
            expected.add((name, None))
    loaded: set[tuple[str, int | None]] = set()
    skipped_reasons: set[str] = set()
    model_name = type(model).__name__

    for ckpt_name, tensor in weights:
        reason = next((why for key, why in weight_map.skip if ckpt_name.startswith(key) or key in ckpt_name), None)
        if reason is not None:
            if reason not in skipped_reasons:
                logger.info("%s: skipping %s (first: %s)", model_name, reason, ckpt_name)
                skipped_reasons.add(reason)
            continue
        name, shard = _map_name(ckpt_name, weight_map)
        if name not in params:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} (shape {tuple(tensor.shape)}) has no parameter in {model_name}")
        target = params[name].data
        if shard is not None:
            target = target[model.get_submodule(name.rpartition(".")[0]).shard_rows(shard)]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)} but {model_name} expects "
                f"{tuple(target.shape)} for {name}" + (f" (shard {shard})" if shard is not None else "")
            )
        target.copy_(convert_dtype(tensor, target.dtype))
        loaded.add((name, shard))

    absent = expected - loaded
    optional = sorted(n for n, _ in absent if n in weight_map.optional)
    missing = sorted(f"{n}" + (f" (shard {s})" if s is not None else "") for n, s in absent if n not in weight_map.optional)
    if missing:
        raise ValueError(f"{model_name} needs {len(missing)} tensor(s) the checkpoint lacks: {missing[:8]}")
    return optional


def _map_name(ckpt_name: str, weight_map: WeightMap) -> tuple[str, int | None]:
    name = ckpt_name
    for old, new in weight_map.prefix_renames:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    for ckpt_module, (merged, shard) in weight_map.packed.items():
        if f".{ckpt_module}." in name:
            return name.replace(f".{ckpt_module}.", f".{merged}."), shard
    return name, None
