"""The KV-cache builder protocol (ROCm/ATOM#631) and its paged implementation.

The model runner sizes, allocates and binds the KV pool only through builders: one for the
target's attention layers and one per draft. All builders share the block size, the block ids
and the block tables, so one block id means "these token slots" in every pool; a block costs
the sum of the builders' per-block bytes. Keys are namespaced (`kv_cache` for the target,
`eagle3_kv_cache` for an EAGLE3 draft) so pools never collide.

An fp8 pool (dtype float8_e4m3fn / float8_e4m3fnuz) comes with its per-tensor scales under
`{prefix}kv_scale` (`kv_scale`, `eagle3_kv_scale`): fp32 [num_layers, num_kv_scales] on the
device, the checkpoint's values or 1.0, each layer bound to 1-element views of its row (graphs
capture the pointers). They do not grow with the pool, so they are not part of a block's bytes.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from model_ops.attention.backends import Role, select_backend
from model_ops.attention.layer import CachedAttention
from model_ops.quant.fp8 import FP8_KV_DTYPES, fp8_max


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
        kv_scales: Sequence[Sequence[float]] | None = None,
    ):
        """`dtype` is the cache's; for an fp8 cache `kv_scales` gives each layer's scales as the
        checkpoint states them for OCP e4m3 (None: 1.0)."""
        if not layers:
            raise ValueError(f"{role} model has no attention layers to cache")
        shapes = {layer.kv_cache_shape(1, block_size) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"{role} attention layers disagree on the cache shape: {sorted(shapes)}")
        self.layers = list(layers)
        self.block_size, self.dtype, self.device, self.role, self.prefix = block_size, dtype, device, role, prefix
        self.backend = select_backend(layers[0].kind, device, role, backend)
        self.pool: torch.Tensor | None = None
        self.scales = self._scale_tensor(kv_scales) if dtype in FP8_KV_DTYPES else None
        if self.scales is None and kv_scales is not None:
            raise ValueError(f"{role} KV scales were given for a {dtype} cache; they belong to an fp8 cache")

    def _scale_tensor(self, kv_scales: Sequence[Sequence[float]] | None) -> torch.Tensor:
        per_layer = self.layers[0].num_kv_scales
        values = torch.ones(len(self.layers), per_layer) if kv_scales is None else torch.tensor(kv_scales).float()
        if tuple(values.shape) != (len(self.layers), per_layer):
            raise ValueError(f"{self.role} KV scales have shape {tuple(values.shape)}; expected "
                             f"({len(self.layers)} layers, {per_layer})")
        if not bool((values > 0).all() and values.isfinite().all()):
            raise ValueError(f"{self.role} KV scales must be finite and positive; got {values.flatten().tolist()}")
        # a checkpoint's scale maps amax to OCP e4m3's 448; e4m3fnuz (MI300) tops out at 240
        values *= fp8_max(torch.float8_e4m3fn) / fp8_max(self.dtype)
        return values.to(self.device)

    @property
    def key(self) -> str:
        return f"{self.prefix}kv_cache"

    @property
    def scale_key(self) -> str:
        return f"{self.prefix}kv_scale"

    def compute_block_bytes(self) -> int:
        per_layer = math.prod(self.layers[0].kv_cache_shape(1, self.block_size))
        return len(self.layers) * per_layer * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache_tensors(self, num_blocks: int) -> dict[str, torch.Tensor]:
        shape = self.layers[0].kv_cache_shape(num_blocks, self.block_size)
        self.pool = torch.zeros(len(self.layers), *shape, dtype=self.dtype, device=self.device)
        return {self.key: self.pool} | ({self.scale_key: self.scales} if self.scales is not None else {})

    def build_kv_cache_tensor(self, module: nn.Module) -> torch.Tensor | None:
        for index, layer in enumerate(self.layers):
            if layer is module:
                if self.pool is None:
                    raise RuntimeError(f"{self.key}: bind requested before allocate_kv_cache_tensors")
                scales = None if self.scales is None else tuple(self.scales[index].split(1))
                layer.bind_kv_cache(self.pool[index], self.backend, scales)
                return self.pool[index]
        return None
