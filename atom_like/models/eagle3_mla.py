"""EAGLE3 / EAGLE3.1 draft with one DeepSeek-MLA decoder layer: Eagle3DeepseekV2ForCausalLM
(lightseekorg kimi-k2.5-eagle3-mla, kimi-k2.6-eagle3.1-mla; as sgl-project/sglang#24826 and #26506).

The layer is the Llama draft's block with DeepseekV2Attention in place of Llama attention: its
q-down and kv-down projections read the 2H-wide [input_layernorm(embed), hidden_norm(hidden)],
then the target's MLA math (q LoRA, kv_a_layernorm, DeepSeek YaRN interleaved RoPE, mscale^2
softmax scale); a dense SwiGLU MLP. Its KV is one MLA layer's latent rows (kv_lora_rank +
qk_rope_head_dim wide), which the proposer pools under `eagle3_kv_cache` with the target's
block ids and tables. fc, fc_norm, norm_output and d2t live in the shared base (Eagle3Draft).

Checkpoint keys, unprefixed as the public drafts ship them: embed_tokens, fc, fc_norm.{i},
layers.0.{input_layernorm, hidden_norm, post_attention_layernorm, self_attn.*, mlp.*}, norm,
lm_head, d2t / t2d; self_attn.q_a_proj + kv_a_proj_with_mqa, or sglang's fusion of the two,
fused_qkv_a_proj_with_mqa (q rows first).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.weights import WeightMap
from atom_like.models.deepseek_v2 import MLA_DIMS, DeepseekV2Attention, check_config, mla_packed_weights
from atom_like.models.eagle3_llama import DRAFT_OPTIONAL, DRAFT_SKIP, Eagle3LlamaLayer
from model_ops.attention.metadata import AttentionMetadata
from model_ops.rotary import RotaryEmbedding
from spec_decode.eagle3 import Eagle3Draft


class Eagle3DeepseekV2ForCausalLM(Eagle3Draft):
    # the draft's config class is DeepseekV3Config (model_type kimi_k2), whose defaults are
    # DeepSeek-V3's dims: a draft silent on its MLA dims must fail, not borrow those
    stated_config_fields = (*Eagle3Draft.stated_config_fields, "q_lora_rank", *MLA_DIMS)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        if config.q_lora_rank is None:
            raise ValueError("draft config has no q_lora_rank: the EAGLE3 MLA draft's q-down projection (q_a_proj) "
                             "reads the 2H-wide [embed, hidden] input, which needs the q LoRA path "
                             "(sglang, vLLM and ATOM require it too)")
        super().__init__(config)
        hidden = config.hidden_size
        rotary = RotaryEmbedding(config, config.qk_rope_head_dim, interleaved=getattr(config, "rope_interleave", True))
        attn = DeepseekV2Attention(config, rotary, input_size=2 * hidden, latent_norm_eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Eagle3LlamaLayer(config, rotary, attn)])

    def decoder_layer(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        return self.layers[0](embeds, hidden, positions, meta)

    def weight_map(self) -> WeightMap:
        # TorchSpec's pre-export name is midlayer.*; sglang-style exports prefix model.
        return WeightMap(prefix_renames=(("midlayer.", "layers.0."), ("model.", "")),
                         packed=mla_packed_weights(self.config), skip=DRAFT_SKIP, optional=DRAFT_OPTIONAL)
