"""Rotary position embeddings: neox layout (Llama) and DeepSeek's interleaved layout.

Frequencies for scaled variants (llama3, yarn incl. DeepSeek's mscale, linear, ...) come from
transformers' own RoPE init functions, so they match the reference models by construction; the
config's `rope_parameters` is transformers' normalised form of either spelling (`rope_scaling`
or `rope_parameters`). cos/sin are computed in fp32 from the positions each step (no
max_position-sized table: Kimi's would span 262,144 positions) and cast to the activation dtype,
exactly as transformers does.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_dim: int, interleaved: bool = False):
        super().__init__()
        params = config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
            attention_factor = 1.0
        elif rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (it rescales with the running sequence length); "
                f"supported: default, {', '.join(t for t in ROPE_INIT_FUNCTIONS if t != 'dynamic')}"
            )
        else:
            with torch.device("cpu"):  # not the build's device context: a meta skeleton needs real values too
                inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        if inv_freq.numel() * 2 != rotary_dim:
            raise ValueError(f"rope frequencies cover {inv_freq.numel() * 2} dims but the rotary dim is {rotary_dim}")
        # transformers computes scaled frequencies on the CPU; models are built under a device context
        self.register_buffer("inv_freq", inv_freq.float().to(torch.get_default_device()), persistent=False)
        self.attention_factor = float(attention_factor)
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (cos, sin), each [T, rotary_dim // 2]."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, rotary_dim]. The neox layout pairs (i, i + d/2); DeepSeek's
        interleaved layout pairs (2i, 2i + 1) and, like transformers, emits the result with the
        even parts first (the same permutation for q and k, so q.k is unchanged)."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
