"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; Kimi-K2.x's language model).

MLA attention over a paged latent cache (model_ops.attention.mla), DeepSeek YaRN RoPE in the
interleaved layout, and a MoE with shared experts after the first dense layers. transformers'
deepseek_v2 / deepseek_v3 code is the oracle; where it differs from the original release code
it is followed and the difference noted.
"""
from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.weights import NameRule, WeightMap
from atom_like.models.base import DecoderModel, DecoderOnlyLM
from atom_like.models.llama import LlamaDecoderLayer, LlamaMLP
from model_ops.attention.metadata import AttentionMetadata
from model_ops.attention.mla import MLAAttention
from model_ops.embed_head import VocabEmbedding
from model_ops.layernorm import RMSNorm
from model_ops.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear, dense_after_rms_norm
from model_ops.moe import FusedExperts, GatingConfig, TopkRouter, expert_weight_rule
from model_ops.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

CosSin = tuple[torch.Tensor, torch.Tensor]


MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_config(config: PretrainedConfig) -> None:
    """Fail early, naming the field, on configs this MLA + MoE model cannot run."""
    name = type(config).__name__
    for field in MLA_DIMS:
        if getattr(config, field, None) is None:
            raise ValueError(f"{name} has no {field}: DeepSeek-V2/V3 attention is MLA and needs "
                             f"kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim in config.json")
    for field in (*MLA_DIMS, "q_lora_rank", "num_attention_heads"):
        value = getattr(config, field, None)
        if value is not None and (type(value) is not int or value <= 0):
            raise ValueError(f"{name}: {field} must be a positive integer (null for q_lora_rank: no q LoRA); "
                             f"got {value!r}")
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"{name}: qk_rope_head_dim {config.qk_rope_head_dim} is odd; RoPE rotates pairs of dims")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")


def mla_softmax_scale(config: PretrainedConfig) -> float:
    """qk_head_dim^-0.5, times mscale^2 under YaRN with `mscale_all_dim`, exactly as transformers'
    DeepseekV3Attention (yarn_apply_mscale) computes it."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


FUSED_QKV_A = "fused_qkv_a_proj_with_mqa"


class DeepseekV2Attention(MLAAttention):
    """MLA projections around the cached core. With a q LoRA, q_a_proj and kv_a_proj_with_mqa read
    the same input, so they are one GEMM: `fused_qkv_a_proj_with_mqa` (q rows first, as sglang
    and vLLM fuse them; `mla_packed_weights` maps the separate checkpoint tensors onto it), then
    q_a_layernorm -> q_b_proj and [c_kv | k_pe] with c_kv through kv_a_layernorm. Without a q
    LoRA, q_proj and kv_a_proj_with_mqa stay separate. On a GPU neither norm is a launch of its
    own: q_a_layernorm is the q_b_proj GEMV's prologue at decode sizes (model_ops.linear.
    dense_after_rms_norm), kv_a_layernorm rides along the cache write (MLAAttention.attend's
    `latent_norm`); the CPU reference runs both as modules.

    `input_size` differs from hidden_size only for EAGLE3 MLA drafts (2H). `latent_norm_eps` is
    the eps of q_a_layernorm / kv_a_layernorm: transformers (and DeepSeek's release code) keep
    the default 1e-6 there, the EAGLE3 MLA drafts' trainers and servers use rms_norm_eps.

    Tensor parallel: the down-projections (q_a, kv_a) and their norms are replicated, so every
    rank computes the whole latent row and keeps it in its cache; q_b / q_proj and kv_b_proj are
    split by heads, o_proj is row-parallel (one all-reduce)."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, input_size: int | None = None,
                 latent_norm_eps: float = 1e-6, reduce_output: bool = True):
        num_heads = config.num_attention_heads
        super().__init__(num_heads, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                         config.v_head_dim, mla_softmax_scale(config))
        width = input_size or config.hidden_size
        bias = getattr(config, "attention_bias", False)
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        kv_a_size = config.kv_lora_rank + config.qk_rope_head_dim
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        heads = "num_attention_heads x head dims"
        if self.q_lora_rank:
            self.fused_qkv_a_proj_with_mqa = MergedLinear(width, [self.q_lora_rank, kv_a_size], bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, latent_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * qk_head_dim, what=heads)
        else:
            self.q_proj = ColumnParallelLinear(width, num_heads * qk_head_dim, what=heads)
            self.kv_a_proj_with_mqa = Linear(width, kv_a_size, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, latent_norm_eps)
        self.o_proj = RowParallelLinear(num_heads * config.v_head_dim, config.hidden_size, bias=bias,
                                        reduce=reduce_output, what=heads)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        if self.q_lora_rank:
            q_a, kv_a = self.fused_qkv_a_proj_with_mqa.split(self.fused_qkv_a_proj_with_mqa(x))
            q = dense_after_rms_norm(q_a, self.q_a_layernorm, self.q_b_proj)  # on a GPU at decode: one kernel
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_nope, q_pe = q.view(x.shape[0], self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        # q_pe and k_pe are rotated, and the latent normalized, as the latent row is written (one
        # kernel on the Triton backend): kv_a_layernorm's output has no other reader
        out = self.attend(q_nope, q_pe, latent, k_pe, meta, rope=(self.rotary, cos_sin), latent_norm=self.kv_a_layernorm)
        return self.o_proj(out)


def mla_packed_weights(config: PretrainedConfig) -> dict[str, tuple[str, int]]:
    """WeightMap.packed entries of DeepseekV2Attention and the dense MLPs: separate checkpoint
    projections as shards of the fused ones (a checkpoint's own fused tensor loads whole)."""
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    if getattr(config, "q_lora_rank", None):
        packed.update(q_a_proj=(FUSED_QKV_A, 0), kv_a_proj_with_mqa=(FUSED_QKV_A, 1))
    return packed


class DeepseekV2MoE(nn.Module):
    """Routed experts weighted by the router, plus unscaled shared experts. Tensor parallel: the
    router is replicated, routed and shared experts are split along their intermediate dim and
    their partial sums are returned together unreduced (LlamaDecoderLayer's contract: the next
    norm all-reduces them, one all-reduce per layer).

    SharedExpertHost (model_ops.moe): one shared expert of the routed experts' size may be fused
    into them as expert E (`shared_slot`), when the quantization config gives it their format."""

    def __init__(self, config: PretrainedConfig, gating: GatingConfig):
        super().__init__()
        self.gate = TopkRouter(config.hidden_size, gating)
        self.experts = FusedExperts(gating.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.num_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = LlamaMLP(config.hidden_size, config.moe_intermediate_size * self.num_shared, reduce=False,
                                       what="moe_intermediate_size x n_shared_experts") if self.num_shared else None
        self.shared_slot: int | None = None  # the shared expert's index in `experts` once fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x, self.shared_slot))
        return out if self.shared_experts is None else out + self.shared_experts(x)

    # SharedExpertHost (model_ops.moe); the MLP's layers never have a bias here
    def fusable_shared_expert(self) -> tuple[nn.Module, list[nn.Module]] | None:
        if self.shared_experts is None or self.num_shared != 1:
            return None
        return self.experts, [self.shared_experts.gate_up_proj, self.shared_experts.down_proj]

    def fuse_shared_expert(self) -> None:
        routed = self.experts
        self.experts = FusedExperts(routed.num_experts + 1, routed.w13.shape[-1], routed.sharding.full)
        self.shared_experts, self.shared_slot = None, routed.num_experts


_SHARED_EXPERT = re.compile(r"^(.*\.layers\.(\d+)\.mlp)\.shared_experts\."
                            r"(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")


def fused_shared_expert_rule(slots: dict[int, int]) -> NameRule:
    """WeightMap rule: the shared expert of decoder layer i, fused as expert `slots[i]`, loads as
    that expert's per-expert tensors (so tensor parallelism cuts it as it cuts a routed expert)."""
    def rule(name: str) -> tuple[str, str | None] | None:
        m = _SHARED_EXPERT.match(name)
        if m is None or int(m[2]) not in slots:
            return None
        return expert_weight_rule(f"{m[1]}.experts.{slots[int(m[2])]}.{m[3]}.{m[4]}")

    return rule


def is_moe_layer(config: PretrainedConfig, index: int) -> bool:
    """DeepSeek's rule: MoE from `first_k_dense_replace` on, every `moe_layer_freq`-th layer
    (transformers reads only first_k_dense_replace; every released config has freq 1)."""
    return index >= (config.first_k_dense_replace or 0) and index % (getattr(config, "moe_layer_freq", None) or 1) == 0


class DeepseekV2Model(DecoderModel):
    def __init__(self, config: PretrainedConfig, gating: GatingConfig | None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # V3 configs say rope_interleave (default true); V2 is always interleaved
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim,
                                      interleaved=getattr(config, "rope_interleave", True))
        self.layers = nn.ModuleList()
        for index in range(config.num_hidden_layers):
            mlp = (DeepseekV2MoE(config, gating) if gating is not None and is_moe_layer(config, index)
                   else LlamaMLP(config.hidden_size, config.intermediate_size, reduce=False))
            attention = DeepseekV2Attention(config, self.rotary, reduce_output=False)
            self.layers.append(LlamaDecoderLayer(config, self.rotary, attention, mlp))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(DecoderOnlyLM):
    stated_config_fields = (*DecoderOnlyLM.stated_config_fields, "q_lora_rank", *MLA_DIMS)  # q_lora_rank may be null
    # routing defaults when config.json omits them (transformers' configs do)
    default_scoring_func = "softmax"
    default_topk_method = "greedy"

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        gating = (GatingConfig.from_config(config, self.default_scoring_func, self.default_topk_method)
                  if getattr(config, "n_routed_experts", None) else None)  # None: every layer dense
        super().__init__(config, DeepseekV2Model(config, gating))

    def weight_map(self) -> WeightMap:
        skip = self.common_skips()
        num_layers = self.config.num_hidden_layers
        num_mtp = getattr(self.config, "num_nextn_predict_layers", None) or 0
        # MTP modules sit after the last decoder layer as model.layers.{N..N+num_mtp-1}
        why = (f"multi-token-prediction layers (num_nextn_predict_layers={num_mtp}: layers {num_layers}.."
               f"{num_layers + num_mtp - 1}; not used for EAGLE3)")
        skip += [(f"model.layers.{num_layers + i}.", why) for i in range(num_mtp)]
        slots = {i: layer.mlp.shared_slot for i, layer in enumerate(self.model.layers)
                 if isinstance(layer.mlp, DeepseekV2MoE) and layer.mlp.shared_slot is not None}
        rules = (expert_weight_rule, fused_shared_expert_rule(slots)) if slots else (expert_weight_rule,)
        return WeightMap(rules=rules, packed=mla_packed_weights(self.config), skip=tuple(skip))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    default_scoring_func = "sigmoid"
    default_topk_method = "noaux_tc"
