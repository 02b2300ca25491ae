"""Checkpoint loading: HF folders with one or many safetensors files.

Each model declares a WeightMap (prefix renames, name rules, checkpoint projections packed into
merged parameters, tensors to skip with the reason logged once); this module does the rest and
refuses to start on a missing, unexpected or mis-shaped tensor, naming it and both shapes.

A parameter filled from several checkpoint tensors (q/k/v into one MergedLinear, per-expert
gate/up/down into stacked expert weights) belongs to a module implementing `ShardedParameters`;
the loader then checks every shard was loaded. Such a parameter may also arrive whole (e.g.
transformers' fused 3-D expert tensors), which counts for all of its shards.

Tensors are copied by value between float types, never between a float and an integer type:
packed MXFP4 bytes (uint8) only ever land in packed parameters, which may check them further
(`CheckedParameters`: no NaN scale byte). Once everything is loaded, modules implementing
`ProcessedAfterLoading` rearrange their parameters for their kernels (aiter's MXFP4 layout).

Under tensor parallelism a module implementing model_ops.tp.TPSharded says which part of each
checkpoint tensor this rank holds, and only that part is read: tensors are memory-mapped
safetensors slices, so no rank ever materialises the full model.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from model_ops import tp
from model_ops.tp import TPSharded, TPSlice

logger = logging.getLogger(__name__)

# A name rule maps a (renamed) checkpoint name to (parameter name, shard), or None to pass.
NameRule = Callable[[str], tuple[str, Hashable | None] | None]


@runtime_checkable
class ShardedParameters(Protocol):
    """A module whose parameters are each assembled from several checkpoint tensors."""

    def weight_shards(self, param: str) -> Sequence[Hashable]:
        """Every shard the parameter `param` (local name, e.g. "weight") is made of."""

    def shard_view(self, param: str, shard: Hashable) -> torch.Tensor:
        """The slice of parameter `param` that checkpoint shard `shard` fills."""


@runtime_checkable
class CheckedParameters(Protocol):
    """A module that validates checkpoint tensors before they are copied into its parameters."""

    def check_tensor(self, param: str, tensor: torch.Tensor) -> None:
        """Raise ValueError saying what is wrong with `tensor` for parameter `param` (local name);
        the loader prefixes the checkpoint tensor's name."""


@runtime_checkable
class ProcessedAfterLoading(Protocol):
    """A module whose kernels read its parameters in a layout of their own (aiter's shuffled MXFP4), or
    take a fact about them as a constant (whether MXFP4 scales fold into the decode's multiply)."""

    def process_weights_after_loading(self) -> None:
        """Rearrange (or inspect) the loaded parameters for the module's kernels; called once, after
        the whole checkpoint is loaded and checked."""


@dataclass(frozen=True)
class WeightMap:
    # (checkpoint prefix, parameter prefix), first match wins: e.g. Kimi's "language_model.model." -> "model."
    prefix_renames: tuple[tuple[str, str], ...] = ()
    # tried in order after the renames and before `packed` (e.g. per-expert -> stacked expert weights)
    rules: tuple[NameRule, ...] = ()
    # checkpoint module name -> (merged module name, shard): "q_proj" -> ("qkv_proj", 0)
    packed: dict[str, tuple[str, int]] = field(default_factory=dict)
    # (prefix or substring of the renamed name, why it is skipped), logged once per reason
    skip: tuple[tuple[str, str], ...] = ()
    # parameters a checkpoint may leave out (an EAGLE3 draft without embed_tokens borrows the target's)
    optional: tuple[str, ...] = ()
    # (parameter prefix, another prefix a quantization config may name the same modules by): a
    # wrapper's exclude list may use the checkpoint's other layouts or its text model's own names
    config_aliases: tuple[tuple[str, str], ...] = ()


def safetensors_files(folder: str) -> list[str]:
    """The shard files of a checkpoint, via model.safetensors.index.json when present."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (JSON with a weight_map of tensor -> file): "
                             f"{type(e).__name__}: {e}; fix it or download it again") from e
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    files = [os.path.join(folder, n) for n in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise ValueError(f"checkpoint {folder!r} has no weight file" + (f": missing {missing}" if missing else " (*.safetensors)"))
    return files


def open_safetensors(path: str):
    """safe_open, failing with the file named: the library's error (e.g. "incomplete metadata")
    does not say which shard of a checkpoint is cut short."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{path} is not a complete safetensors file ({e}): the download or conversion was cut "
                         "short; fetch or write this file again") from e


def check_checkpoint_files(folder: str) -> list[str]:
    """The shard files, each header read and checked against the file size (cheap: no tensor is
    read), so a file cut short fails before a model is built or loaded."""
    files = safetensors_files(folder)
    for path in files:
        with open_safetensors(path):
            pass
    return files


class CheckpointTensor:
    """One tensor of an open safetensors file, read only when asked: whole, or the slices one
    tensor-parallel rank holds (memory-mapped, so only those bytes are read)."""

    def __init__(self, handle, name: str):
        self._handle, self._slice = handle, handle.get_slice(name)
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def read(self, part: TPSlice | None = None, param: str = "") -> torch.Tensor:
        if part is None:
            return self._handle.get_tensor(self.name)
        return torch.cat([self._slice[index] for index in part.stored_index(param)], dim=part.dim)


def iter_checkpoint(folder: str, desc: str = "Loading weights") -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of a checkpoint, lazily (valid until the next one is yielded)."""
    files = check_checkpoint_files(folder)
    for path in tqdm(files, desc=desc, unit="shard", disable=len(files) < 2 or tp.rank() != 0):
        with open_safetensors(path) as f:
            for name in f.keys():
                yield name, CheckpointTensor(f, name)


def checkpoint_keys(folder: str) -> set[str]:
    """Tensor names of a checkpoint, read from the file headers only."""
    keys: set[str] = set()
    for path in safetensors_files(folder):
        with open_safetensors(path) as f:
            keys.update(f.keys())
    return keys


def convert_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ROCm/ATOM#631's rule: same-width float formats are bit-compatible encodings (fp8 variants) and
    are viewed; fp16 <-> bf16 have the same width but different ranges, so they are converted by
    value, as is every other pair. Integer and float tensors are never converted into each other:
    packed MXFP4 bytes (uint8) read as numbers would be garbage."""
    if tensor.dtype == dtype:
        return tensor
    if tensor.is_floating_point() != dtype.is_floating_point:
        raise ValueError(f"refusing to convert a {tensor.dtype} checkpoint tensor to {dtype}: integer (e.g. packed "
                         "MXFP4) and float tensors are never converted into each other")
    same_width = tensor.element_size() == torch.empty((), dtype=dtype).element_size()
    if same_width and tensor.is_floating_point() and dtype.is_floating_point and {tensor.dtype, dtype} != {torch.float16, torch.bfloat16}:
        return tensor.view(dtype)
    return tensor.to(dtype)


def _shards(model: nn.Module, name: str) -> list[Hashable | None]:
    """The shards parameter `name` is loaded as ([None] when it is loaded whole)."""
    module_name, _, local = name.rpartition(".")
    module = model.get_submodule(module_name)
    return list(module.weight_shards(local)) if isinstance(module, ShardedParameters) else [None]


def tp_part(model: nn.Module, name: str, shard: Hashable | None) -> TPSlice | None:
    """What this rank loads of the checkpoint tensor filling parameter `name` (or its `shard`)."""
    module_name, _, local = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module.tp_slice(local, shard) if isinstance(module, TPSharded) else None


def check_tp_slices(model: nn.Module) -> None:
    """Raise, naming the parameter, where this rank's part of a tensor would cut a quantization
    block (run on a meta-device skeleton before any worker starts)."""
    for name in dict(model.named_parameters()):
        for shard in {*_shards(model, name), None}:
            part = tp_part(model, name, shard)
            if part is not None:
                part.stored_index(name if shard is None else f"{name} (shard {shard})")


def load_weights(model: nn.Module, weights: Iterator[tuple[str, CheckpointTensor]], weight_map: WeightMap) -> list[str]:
    """Load every parameter of `model` (this tensor-parallel rank's part of each); returns the
    optional ones the checkpoint lacked."""
    params = dict(model.named_parameters())
    expected = {(name, shard) for name in params for shard in _shards(model, name)}
    loaded: set[tuple[str, Hashable | None]] = set()
    skipped_reasons: set[str] = set()
    model_name = type(model).__name__

    for ckpt_name, tensor in weights:
        renamed = rename(ckpt_name, weight_map)
        reason = next((why for key, why in weight_map.skip if renamed.startswith(key) or key in renamed), None)
        if reason is not None:
            if reason not in skipped_reasons:
                logger.info("%s: skipping %s (first: %s)", model_name, reason, ckpt_name)
                skipped_reasons.add(reason)
            continue
        name, shard = _map_name(renamed, weight_map)
        if name not in params:
            hint = ("; the checkpoint packs this layer (MXFP4) but its quantization_config leaves it unquantized"
                    if ckpt_name.endswith(".weight_scale") else "")
            raise ValueError(f"checkpoint tensor {ckpt_name!r} (shape {tensor.shape}) has no parameter in "
                             f"{model_name}{hint}")
        module_name, _, local = name.rpartition(".")
        module = model.get_submodule(module_name)
        target = params[name].data if shard is None else module.shard_view(local, shard)
        part = tp_part(model, name, shard)
        whole = list(target.shape)
        if part is not None:  # the whole tensor this rank's part is cut from
            whole[part.dim] = part.full // part.pack
        # this rank's part; a tensor of another shape is read whole, only to be checked and refused below
        data = tensor.read(part, name) if tensor.shape == tuple(whole) else tensor.read()
        if isinstance(module, CheckedParameters):
            try:
                module.check_tensor(local, data)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} {e}") from None
        if data.is_floating_point() != target.is_floating_point():
            raise ValueError(f"checkpoint tensor {ckpt_name!r} is {data.dtype} but {model_name}.{name} is "
                             f"{target.dtype}: integer (e.g. packed MXFP4) and float tensors are never converted "
                             "into each other; is the checkpoint's quantization_config missing or wrong?")
        if tensor.shape != tuple(whole):
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tensor.shape} but {model_name} expects "
                f"{tuple(whole)} for {name}" + (f" (shard {shard})" if shard is not None else "")
            )
        target.copy_(convert_dtype(data, target.dtype))
        loaded.update([(name, shard)] if shard is not None else [(name, s) for s in _shards(model, name)])

    absent = expected - loaded
    optional = sorted(n for n, _ in absent if n in weight_map.optional)
    missing = sorted(f"{n}" + (f" (shard {s})" if s is not None else "") for n, s in absent if n not in weight_map.optional)
    if missing:
        raise ValueError(f"{model_name} needs {len(missing)} tensor(s) the checkpoint lacks: {missing[:8]}")
    process_after_loading(model)
    return optional


def process_after_loading(model: nn.Module) -> None:
    """Once every parameter holds its value: let modules rearrange theirs for their kernels."""
    for module in model.modules():
        if isinstance(module, ProcessedAfterLoading):
            module.process_weights_after_loading()


def rename(ckpt_name: str, weight_map: WeightMap) -> str:
    for old, new in weight_map.prefix_renames:
        if ckpt_name.startswith(old):
            return new + ckpt_name[len(old):]
    return ckpt_name


def _map_name(name: str, weight_map: WeightMap) -> tuple[str, Hashable | None]:
    for rule in weight_map.rules:
        mapped = rule(name)
        if mapped is not None:
            return mapped
    for ckpt_module, (merged, shard) in weight_map.packed.items():
        if f".{ckpt_module}." in name:
            return name.replace(f".{ckpt_module}.", f".{merged}."), shard
    return name, None
