"""The KV-cache builder protocol (ROCm/ATOM#631) and its paged implementation.

The model runner sizes, allocates and binds the KV pool only through builders: one for the
target's attention layers and one per draft. All builders share the block size, the block ids
and the block tables, so one block id means "these token slots" in every pool; a block costs
the sum of the builders' per-block bytes. Keys are namespaced (`kv_cache` for the target,
`eagle3_kv_cache` for an EAGLE3 draft) so pools never collide.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from model_ops.attention.backends import Role, select_backend
from model_ops.attention.layer import CachedAttention


@runtime_checkable
class KVCacheBuilder(Protocol):
    def compute_block_bytes(self) -> int:
        """KV bytes one block costs across the layers this builder owns."""

    def allocate_kv_cache_tensors(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Allocate this builder's pool(s) for `num_blocks` blocks, under namespaced keys."""

    def build_kv_cache_tensor(self, module: nn.Module) -> torch.Tensor | None:
        """Bind `module` to its cache view if this builder owns it; None otherwise."""


class PagedKVCacheBuilder:
    """One pool tensor [num_layers, *layer.kv_cache_shape] for a model's attention layers."""

    def __init__(
        self,
        layers: Sequence[CachedAttention],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        role: Role,
        prefix: str = "",
        backend: str = "auto",
    ):
        if not layers:
            raise ValueError(f"{role} model has no attention layers to cache")
        shapes = {layer.kv_cache_shape(1, block_size) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"{role} attention layers disagree on the cache shape: {sorted(shapes)}")
        self.layers = list(layers)
        self.block_size, self.dtype, self.device, self.role, self.prefix = block_size, dtype, device, role, prefix
        self.backend = select_backend(layers[0].kind, device, role, backend)
        self.pool: torch.Tensor | None = None

    @property
    def key(self) -> str:
        return f"{self.prefix}kv_cache"

    def compute_block_bytes(self) -> int:
        per_layer = math.prod(self.layers[0].kv_cache_shape(1, self.block_size))
        return len(self.layers) * per_layer * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache_tensors(self, num_blocks: int) -> dict[str, torch.Tensor]:
        shape = self.layers[0].kv_cache_shape(num_blocks, self.block_size)
        self.pool = torch.zeros(len(self.layers), *shape, dtype=self.dtype, device=self.device)
        return {self.key: self.pool}

    def build_kv_cache_tensor(self, module: nn.Module) -> torch.Tensor | None:
        for index, layer in enumerate(self.layers):
            if layer is module:
                if self.pool is None:
                    raise RuntimeError(f"{self.key}: bind requested before allocate_kv_cache_tensors")
                layer.bind_kv_cache(self.pool[index], self.backend)
                return self.pool[index]
        return None
