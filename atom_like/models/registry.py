"""Architecture name (config.json `architectures[0]`) -> model class."""
from __future__ import annotations

from transformers import PretrainedConfig

from atom_like.models.base import CausalLM
from atom_like.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from atom_like.models.kimi_k25 import KimiK25ForConditionalGeneration
from atom_like.models.llama import LlamaForCausalLM

TARGET_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # the hub checkpoint's (remote-code) name, and transformers' native class name
    "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration,
    "Kimi_K25ForConditionalGeneration": KimiK25ForConditionalGeneration,
}


def target_model_class(config: PretrainedConfig) -> type[CausalLM]:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in TARGET_MODELS:
            return TARGET_MODELS[arch]
    raise ValueError(
        f"unknown model architecture {archs or '(config.json has no architectures)'}; "
        f"supported: {', '.join(sorted(TARGET_MODELS))}"
    )
