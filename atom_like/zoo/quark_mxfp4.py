"""Write a checkpoint in AMD Quark's MXFP4 layout: what amd-quark 0.13 exports, tensor for tensor.

Why our own writer: Quark quantizes `nn.Linear` modules only, and transformers 5 keeps routed
experts as 3-D parameters, so Quark run on a transformers model exports the experts unquantized.
This writer quantizes a float checkpoint's tensors directly with model_ops.quant.mxfp4, which is
Quark's packing and "even" scale rule bit for bit (tests/test_quark_export.py runs amd-quark on
per-expert Linear modules and compares every tensor and the config), and writes Quark's
`quantization_config`.

Styles (which Linear layers stay in the float dtype; the router, embeddings and lm_head always do):
  * "released" (AMD's Kimi-K2.5-MXFP4 card: `--exclude_layers "*self_attn* *mlp.gate *lm_head
    *mm_projector* *vision_tower*"`): routed experts, shared experts and dense MLPs are MXFP4.
  * "experts_only" (amd-quark 0.13's kimi_k25 template, ATOM's recipe text): dense MLPs
    (`*mlp.gate_proj` ...) and `*shared_experts*` excluded too: only routed experts are MXFP4.
`exclude_as="names"` writes the exclude list as Quark's exporter does (each excluded Linear by
its full name); "patterns" keeps the globs, as a hand-written config might.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import shutil
from pathlib import Path
from typing import Literal

import torch

from atom_like.zoo.checkpoint import INDEX_NAME, load_tensors, save_sharded
from model_ops.quant.mxfp4 import quantize_mxfp4

Style = Literal["released", "experts_only"]
EXCLUDES: dict[str, list[str]] = {
    "released": ["*self_attn*", "*mlp.gate", "*lm_head", "*mm_projector*", "*vision_tower*"],
    "experts_only": ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj",
                     "*shared_experts*", "*mm_projector*", "*vision_tower*"],
}
# the nn.Linear modules of DeepSeek / Kimi / Llama checkpoints (what Quark would wrap)
LINEAR_LEAVES = {"q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                 "gate_proj", "up_proj", "down_proj", "lm_head"}
KV_CACHE_GROUP = ["*kv_a_proj_with_mqa", "*kv_b_proj"]  # MLA; MHA models use *k_proj, *v_proj

_MXFP4 = {"dtype": "fp4", "observer_cls": "PerBlockMXObserver", "qscheme": "per_group", "ch_axis": -1,
          "group_size": 32, "block_size": None, "symmetric": None, "round_method": "half_even",
          "scale_type": "float", "scale_format": "e8m0", "scale_calculation_mode": "even", "mx_element_dtype": None,
          "zero_point_type": "int32", "is_scale_quant": False, "enable_buffer_reuse": False,
          "max_input_numel": 4194304}
_FP8_KV = {"dtype": "fp8_e4m3", "observer_cls": "PerTensorMinMaxObserver", "qscheme": "per_tensor", "ch_axis": None,
           "group_size": None, "block_size": None, "symmetric": True, "round_method": "half_even", "scale_type": None,
           "scale_format": None, "scale_calculation_mode": None, "mx_element_dtype": None, "zero_point_type": "int32",
           "is_scale_quant": False, "enable_buffer_reuse": False, "max_input_numel": 4194304}


def _layer(weight: dict | None, inputs: dict | None, outputs: dict | None = None) -> dict:
    return {"bias": None, "input_tensors": inputs, "output_tensors": outputs, "target_device": None, "weight": weight}


def quantization_config(exclude: list[str], activations: bool = True, kv_cache: bool = False) -> dict:
    """Quark 0.13's exported `quantization_config` for MXFP4 weights (+ dynamic MXFP4 inputs when
    `activations`; + static fp8 KV-cache output scales of the MLA kv projections when `kv_cache`)."""
    inputs = dict(_MXFP4, is_dynamic=True) if activations else None
    mx_layer = _layer(dict(_MXFP4, is_dynamic=False), inputs)
    kv_layers = {p: _layer(copy.deepcopy(mx_layer["weight"]), copy.deepcopy(inputs), dict(_FP8_KV, is_dynamic=False))
                 for p in KV_CACHE_GROUP} if kv_cache else {}
    return {
        "algo_config": None, "exclude": list(exclude),
        "export": {"kv_cache_group": list(KV_CACHE_GROUP) if kv_cache else [], "min_kv_scale": 0.0,
                   "pack_method": "reorder", "weight_format": "real_quantized", "weight_merge_groups": None},
        "global_quant_config": mx_layer, "kv_cache_post_rope": False,
        "kv_cache_quant_config": {p: _layer(None, None, dict(_FP8_KV, is_dynamic=False)) for p in kv_layers},
        "layer_quant_config": kv_layers, "layer_type_quant_config": {}, "quant_method": "quark",
        "quant_mode": "eager_mode", "softmax_quant_spec": None, "version": "0.13",
    }


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def quantize_tensors(tensors: dict[str, torch.Tensor], style: Style) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Pack every Linear weight `style` quantizes (uint8 `weight` + E8M0 `weight_scale`); returns
    the new tensors and the names of the Linear modules left unquantized."""
    patterns = EXCLUDES[style]
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, t in tensors.items():
        module, _, param = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if param != "weight" or leaf not in LINEAR_LEAVES or t.dim() != 2:
            out[name] = t
        elif _excluded(module, patterns):
            out[name] = t
            kept.append(module)
        else:
            out[name], out[f"{module}.weight_scale"] = quantize_mxfp4(t.float())
    return out, kept


def write(tensors: dict[str, torch.Tensor], config: dict, dst: str | Path, style: Style = "released",
          exclude_as: Literal["names", "patterns"] = "names", activations: bool = True,
          kv_scales: dict[str, float] | None = None) -> list[Path]:
    """Write float checkpoint `tensors` + `config` (HF layout, per-expert tensors) as a Quark MXFP4
    checkpoint in `dst` (weights and config.json). `kv_scales` ({MLA attention module name: scale},
    e.g. from calibration) adds Quark's fp8 KV-cache scales: `<attn>.kv_a_proj_with_mqa.output_scale`
    and an equal `kv_b_proj` one (one kv_cache_group)."""
    tensors, kept = quantize_tensors(tensors, style)
    for attn, scale in (kv_scales or {}).items():
        for proj in ("kv_a_proj_with_mqa", "kv_b_proj"):
            tensors[f"{attn}.{proj}.output_scale"] = torch.tensor(float(scale), dtype=torch.float32)
    exclude = sorted(kept) if exclude_as == "names" else EXCLUDES[style]
    config = dict(config, quantization_config=quantization_config(exclude, activations, kv_cache=bool(kv_scales)))
    files = save_sharded(tensors, Path(dst))
    (Path(dst) / "config.json").write_text(json.dumps(config, indent=2))
    return files


def convert(src: str | Path, dst: str | Path, **options) -> Path:
    """`write` for a float checkpoint folder `src` (tokenizer and other files copied along)."""
    src, dst = Path(src), Path(dst)
    # transformers 5.23 saves Kimi's text layers as `blocks` (kimi_k25.py); releases say `layers`
    tensors = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v
               for k, v in load_tensors(src).items()}
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        skip = f.name.endswith(".safetensors") or f.name in ("config.json", "zoo.json", INDEX_NAME)
        if f.is_file() and not skip:
            shutil.copy(f, dst / f.name)
    write(tensors, json.loads((src / "config.json").read_text()), dst, **options)
    return dst
