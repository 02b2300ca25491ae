"""Architecture name (config.json `architectures[0]`) -> model class."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.models.base import CausalLM
from atom_like.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from atom_like.models.eagle3_llama import Eagle3LlamaForCausalLM
from atom_like.models.eagle3_mla import Eagle3DeepseekV2ForCausalLM
from atom_like.models.kimi_k25 import KimiK25ForConditionalGeneration
from atom_like.models.llama import LlamaForCausalLM
from model_ops.deferred import deferred_weights, materialize
from spec_decode.eagle3 import Eagle3Draft

TARGET_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # the hub checkpoint's (remote-code) name, and transformers' native class name
    "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration,
    "Kimi_K25ForConditionalGeneration": KimiK25ForConditionalGeneration,
}


# EAGLE3 drafts: the family is chosen from `architectures` alone.
DRAFT_MODELS: dict[str, type[Eagle3Draft]] = {
    "LlamaForCausalLMEagle3": Eagle3LlamaForCausalLM,  # lightseekorg / SpecForge
    "Eagle3LlamaForCausalLM": Eagle3LlamaForCausalLM,  # vLLM's name for the same layout
    "Eagle3DeepseekV2ForCausalLM": Eagle3DeepseekV2ForCausalLM,  # MLA drafts (kimi-k2.x-eagle3[.1]-mla)
}


def _lookup(config: PretrainedConfig, table: dict, what: str):
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in table:
            return table[arch]
    raise ValueError(f"unknown {what} architecture {archs or '(config.json has no architectures)'}; "
                     f"supported: {', '.join(sorted(table))}")


def target_model_class(config: PretrainedConfig) -> type[CausalLM]:
    return _lookup(config, TARGET_MODELS, "model")


def draft_model_class(config: PretrainedConfig) -> type[Eagle3Draft]:
    return _lookup(config, DRAFT_MODELS, "draft")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cls: type[nn.Module], config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                quantize: Callable[[nn.Module], object] | None = None):
    """Instantiate `cls(config)` with its parameters created directly on `device` in `dtype`.

    `quantize(model)` swaps layers for quantized ones before any replaceable layer's float
    weights are allocated (model_ops.deferred)."""
    with default_dtype(dtype), torch.device(device), deferred_weights(quantize is not None):
        model = cls(config)
        if quantize is not None:
            quantize(model)
    materialize(model, device)
    return model.eval()
