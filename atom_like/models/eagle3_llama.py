"""EAGLE3 draft with one Llama (MHA/GQA) decoder layer: LlamaForCausalLMEagle3.

Checkpoint layout of the lightseekorg/SpecForge drafts: `fc`, `midlayer.*` (or `layers.0.*`),
`norm`, `lm_head`, optional `embed_tokens`, `d2t`/`t2d` when the draft vocabulary is smaller,
`fc_norm.{i}` for EAGLE3.1. The layer's q/k/v projections read the 2H-wide concatenation
[input_layernorm(embed), hidden_norm(hidden)]; its residual is the un-normalised hidden.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.kv_scales import KV_SCALE_SKIP
from atom_like.loader.weights import WeightMap
from atom_like.models.llama import LlamaAttention, LlamaMLP, llama_head_dim
from model_ops.attention.metadata import AttentionMetadata
from model_ops.layernorm import RMSNorm
from model_ops.rotary import RotaryEmbedding
from spec_decode.eagle3 import Eagle3Draft

# checkpoint names shared by every EAGLE3 draft family
DRAFT_SKIP = (("t2d", "t2d (target->draft vocabulary mask; only used in training)"), KV_SCALE_SKIP)
DRAFT_OPTIONAL = ("embed_tokens.weight", "lm_head.weight")


class Eagle3LlamaLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding | None = None,
                 self_attn: nn.Module | None = None):
        """`rotary` / `self_attn` (reading the 2H-wide input) replace Llama's: the MLA draft reuses
        this block with DeepSeek MLA, as DeepSeek reuses LlamaDecoderLayer."""
        super().__init__()
        hidden = config.hidden_size
        self.rotary = RotaryEmbedding(config, llama_head_dim(config)) if rotary is None else rotary
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, self.rotary, input_size=2 * hidden) if self_attn is None else self_attn
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = LlamaMLP(hidden, config.intermediate_size, getattr(config, "mlp_bias", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.self_attn(x, self.rotary.cos_sin(positions, x.dtype), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3LlamaForCausalLM(Eagle3Draft):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.midlayer = Eagle3LlamaLayer(config)

    def decoder_layer(self, embeds, hidden, positions, meta):
        return self.midlayer(embeds, hidden, positions, meta)

    def weight_map(self) -> WeightMap:
        packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        return WeightMap(prefix_renames=(("layers.0.", "midlayer."), ("model.layers.0.", "midlayer."), ("model.", "")),
                         packed=packed, skip=DRAFT_SKIP, optional=DRAFT_OPTIONAL)
