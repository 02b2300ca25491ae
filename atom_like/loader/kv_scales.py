"""Per-tensor fp8 KV-cache scales a checkpoint carries, for `--kv-cache-dtype fp8`.

AMD Quark (`kv_cache_scheme="fp8"`, 0.13 checked) stores them as scalar fp32 `output_scale`
tensors of the projections whose outputs feed the cache: `<attn>.k_proj.output_scale` /
`<attn>.v_proj.output_scale` for MHA, and `<attn>.kv_a_proj_with_mqa.output_scale` (plus an
equal `kv_b_proj.output_scale`, the same kv_cache_group) for MLA. A scale maps the calibrated
amax onto e4m3's 448. The MLA latent row has one scale: the larger of the two when both are
present. Layers without one get 1.0, announced in one warning line. The loader skips these
tensors (KV_SCALE_SKIP); with an unquantized cache they are unused.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from safetensors import safe_open
from torch import nn

from atom_like.loader.weights import WeightMap, rename, safetensors_files
from model_ops.attention.layer import CachedAttention

logger = logging.getLogger(__name__)

SUFFIX = ".output_scale"
KV_SCALE_SKIP = (SUFFIX, "per-tensor KV-cache scales (*.output_scale, read for --kv-cache-dtype fp8)")
# projection -> which of a layer's scales it sets: MHA (k, v); MLA (latent,) from either projection
_SLOTS = {"k_proj": 0, "v_proj": 1, "kv_a_proj_with_mqa": 0, "kv_b_proj": 0}


def _layer_of(model: nn.Module, attn_path: str, ckpt_name: str) -> CachedAttention:
    try:
        module = model.get_submodule(attn_path)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {ckpt_name!r}: {type(model).__name__} has no attention module "
                         f"{attn_path!r} for this KV-cache scale") from None
    found = [m for m in module.modules() if isinstance(m, CachedAttention)]
    if len(found) != 1:
        raise ValueError(f"checkpoint tensor {ckpt_name!r}: {attn_path!r} holds {len(found)} cached attention "
                         "layers; expected one")
    return found[0]


def read_kv_scales(folder: str, model: nn.Module, layers: Sequence[CachedAttention], weight_map: WeightMap,
                   role: str) -> list[tuple[float, ...]]:
    """Each layer's fp8 scales (in `layers` order) from checkpoint `folder`; 1.0 where absent."""
    index = {id(layer): i for i, layer in enumerate(layers)}
    found: list[list[float | None]] = [[None] * layer.num_kv_scales for layer in layers]
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if not ckpt_name.endswith(SUFFIX):
                    continue
                attn_path, _, projection = rename(ckpt_name, weight_map).removesuffix(SUFFIX).rpartition(".")
                if projection not in _SLOTS:
                    continue
                value = _scale_value(f.get_tensor(ckpt_name), ckpt_name)
                layer = _layer_of(model, attn_path, ckpt_name)
                if id(layer) not in index:
                    continue
                slot = _SLOTS[projection] if layer.num_kv_scales > 1 else 0
                current = found[index[id(layer)]][slot]
                found[index[id(layer)]][slot] = value if current is None else max(current, value)
    missing = sum(v is None for row in found for v in row)
    if missing:
        total = sum(len(row) for row in found)
        logger.warning("fp8 KV cache (%s): %s has no KV-cache scale for %d of %d cache tensors; using 1.0 for them",
                       role, folder, missing, total)
    return [tuple(1.0 if v is None else v for v in row) for row in found]


def _scale_value(tensor: torch.Tensor, name: str) -> float:
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise ValueError(f"checkpoint tensor {name!r} ({tensor.dtype}, shape {tuple(tensor.shape)}) is not one "
                         "per-tensor float scale")
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale of {value}; scales must be finite and > 0")
    return value
