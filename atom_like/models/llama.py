"""Llama (LlamaForCausalLM): RMSNorm, RoPE (incl. llama3 / yarn scaling), GQA, SwiGLU.

Tensor parallel (model_ops.tp): heads split across ranks (KV heads replicated when there are
fewer than ranks), o_proj and down_proj row-parallel with one all-reduce each, the MLP split
along its intermediate dim, vocab-parallel embedding and head."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.weights import WeightMap
from atom_like.models.base import DecoderModel, DecoderOnlyLM
from model_ops.activation import silu_and_mul
from model_ops.attention.layer import PagedAttention
from model_ops.attention.metadata import AttentionMetadata
from model_ops.embed_head import VocabEmbedding
from model_ops.layernorm import RMSNorm
from model_ops.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_ops.rotary import RotaryEmbedding

CosSin = tuple[torch.Tensor, torch.Tensor]


def llama_head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, reduce: bool = True,
                 what: str = "intermediate_size"):
        """Tensor-parallel over the intermediate dim; `reduce=False` returns this rank's partial
        sum (DeepSeek's shared experts, reduced with the routed ones)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, what=what)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce=reduce, what=what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, MergedColumnParallelLinear):  # float weights (not replaced by MXFP4)
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, input_size: int | None = None,
                 reduce_output: bool = True):
        """`input_size` differs from hidden_size only for EAGLE3 drafts (2H-wide input);
        `reduce_output=False` returns o_proj's partial sums (LlamaDecoderLayer reduces them in its norm)."""
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = llama_head_dim(config)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(input_size or config.hidden_size, num_heads, num_kv_heads, self.head_dim, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=bias,
                                        reduce=reduce_output, what="attention heads x head_dim")
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k, v = (t.view(-1, heads, self.head_dim) for t, heads in
                   ((q, self.num_heads), (k, self.num_kv_heads), (v, self.num_kv_heads)))
        out = self.attn(q, k, v, meta, rope=(self.rotary, cos_sin))  # rotated as the cache is written
        return self.o_proj(out.flatten(1))


class LlamaDecoderLayer(nn.Module):
    """A pre-norm residual block whose attention and MLP end in row-parallel layers left
    unreduced: each partial sum is all-reduced by the norm after it, fused with the residual add
    and the norm where model_ops.tp can (RMSNorm.reduce_add_forward). The input norm belongs to
    the block but is applied by run_decoder_layers (atom_like.models.base), which reduces the
    previous block's MLP output there and captures the residual stream it yields for EAGLE3."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, self_attn: nn.Module | None = None,
                 mlp: nn.Module | None = None):
        """`self_attn` / `mlp` replace Llama's (DeepSeek reuses this block with MLA and MoE): both
        must return unreduced partial sums (built with reduce_output / reduce False)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, reduce_output=False) if self_attn is None else self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if mlp is None:
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False),
                           reduce=False)
        self.mlp = mlp

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, cos_sin: CosSin,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`normed`: input_layernorm's output; returns (the MLP's partial sums, the residual stream
        after attention); all-reduced, their sum is the next block's input stream."""
        hidden = self.self_attn(normed, cos_sin, meta)
        hidden, residual = self.post_attention_layernorm.reduce_add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(DecoderModel):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, llama_head_dim(config))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(DecoderOnlyLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, LlamaModel(config))

    def weight_map(self) -> WeightMap:
        skip = self.common_skips()
        packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        return WeightMap(packed=packed, skip=tuple(skip))
