"""Linear layers. MergedLinear holds several checkpoint projections (q/k/v, gate/up) in one
weight so a step runs one GEMM instead of several; the loader fills it shard by shard."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_ops.deferred import weight_device


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # on the meta device while a quantization config may still replace this layer (model_ops.deferred)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=weight_device()), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=weight_device()), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Output rows are the concatenation of `output_sizes` projections (shard 0 first)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    # ShardedParameters (atom_like.loader.weights): weight and bias are both cut by output rows.
    def weight_shards(self, param: str) -> range:
        return range(len(self.output_sizes))

    def shard_view(self, param: str, shard: int) -> torch.Tensor:
        return getattr(self, param).data[self.shard_rows(shard)]

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.output_sizes, dim=-1)
