"""Attention layers that own a slice of the paged KV pool.

A layer says what one cache looks like (`kv_cache_shape`) and how many fp8 scales it takes; a
KV builder allocates the pool and binds each layer's view, its scales (fp8 caches only) and the
backend chosen for it. Model code only calls `forward`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from model_ops.attention.backends import AttentionBackend, AttentionKind, CosSin, KVScales, MHABackend
from model_ops.attention.metadata import AttentionMetadata
from model_ops.rotary import RotaryEmbedding

# a step's rotation for layers that rotate while writing their cache: the layer's rotary and cos/sin rows
Rope = tuple[RotaryEmbedding, CosSin]


class CachedAttention(nn.Module, ABC):
    kind: AttentionKind
    # fp8 KV-cache scales per layer: K and V for MHA, one for MLA's latent rows (KVScales)
    num_kv_scales: int

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.kv_scales: KVScales = None

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of this layer's cache for a pool of `num_blocks` blocks."""

    def bind_kv_cache(self, cache: torch.Tensor, backend: AttentionBackend, scales: KVScales = None) -> None:
        self.kv_cache, self.backend, self.kv_scales = cache, backend, scales

    def _bound(self) -> tuple[torch.Tensor, AttentionBackend]:
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError(f"{type(self).__name__} ran before a KV builder bound its cache")
        return self.kv_cache, self.backend


class PagedAttention(CachedAttention):
    """Multi-head / grouped-query attention over a paged K/V cache."""

    kind: AttentionKind = "mha"
    num_kv_scales = 2

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                rope: Rope) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens, q and k not rotated yet -> [T, Hq, D].
        The backend rotates q and k by `rope` as it writes the cache (one kernel on Triton). Over an
        fp8 cache every key and value, this step's included, is read back dequantized, as vLLM's
        FlashAttention backend does (unlike MLA prefill: MLAAttention.attend)."""
        cache, backend = self._bound()
        if not isinstance(backend, MHABackend):
            raise TypeError(f"MHA layer bound to {type(backend).__name__}, which is not an MHABackend")
        q = backend.write_rotated(cache, q, (k, v), *rope, meta.slot_mapping, self.kv_scales)
        return backend.attend(q, cache, meta, self.scale, self.kv_scales)
