"""Attention backends and the one place that picks a backend for a layer.

A backend is the pair (KV write, paged attention) for one cache layout. The torch reference runs
everywhere and is the oracle; faster backends (Triton on any GPU, aiter on ROCm) register here
and are chosen by `select_backend` alone, so model code never changes when a backend is added.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from model_ops.attention import torch_ref
from model_ops.attention.metadata import AttentionMetadata

AttentionKind = Literal["mha", "mla"]
Role = Literal["target", "draft"]


class AttentionBackend(ABC):
    """Writes a layer's new KV rows into its paged cache and attends over the cache.

    `cache` is one layer's view of the pool, shaped by the layer's `kv_cache_shape`.
    """

    name: str

    @abstractmethod
    def write(self, cache: torch.Tensor, rows: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor) -> None: ...

    @abstractmethod
    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class TorchMHABackend(AttentionBackend):
    """MHA/GQA cache [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)."""

    name = "torch"

    def write(self, cache, rows, slot_mapping):
        key, value = rows
        torch_ref.write_cache(cache[0], key, slot_mapping)
        torch_ref.write_cache(cache[1], value, slot_mapping)

    def attend(self, q, cache, meta, scale):
        return torch_ref.paged_attention(q, cache[0], cache[1], meta, scale)


_BACKENDS: dict[tuple[AttentionKind, str], type[AttentionBackend]] = {("mha", "torch"): TorchMHABackend}


def register_backend(kind: AttentionKind, backend: type[AttentionBackend]) -> None:
    _BACKENDS[(kind, backend.name)] = backend


def select_backend(kind: AttentionKind, device: torch.device, role: Role) -> AttentionBackend:
    """The backend for a layer of `kind` serving `role` on `device`.

    CPU always takes the torch reference. On a GPU the fastest registered backend wins, except
    that pure-MHA draft layers never take aiter's paged attention: its assembly kernels read block
    `id & 0xFFFF` once a draft pool passes 65,535 blocks (ROCm/ATOM#702, seed 004).
    """
    if device.type != "cpu":
        for name in ("aiter", "triton"):
            if name == "aiter" and kind == "mha" and role == "draft":
                continue
            if (kind, name) in _BACKENDS:
                return _BACKENDS[(kind, name)]()
    return _BACKENDS[(kind, "torch")]()
