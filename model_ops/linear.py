"""Linear layers. MergedLinear holds several checkpoint projections (q/k/v, gate/up) in one
weight so a step runs one GEMM instead of several; the loader fills it shard by shard.

Tensor parallelism (Megatron-style, model_ops.tp): a column-parallel layer holds this rank's
rows of the output features and leaves its output split (the next op is per head, or a
row-parallel layer); a row-parallel layer holds this rank's columns of the input features and
sums the ranks' partial products with one all-reduce. `Linear` itself is replicated. At -tp 1
every parallel layer is exactly the plain one.
"""
from __future__ import annotations

from collections.abc import Hashable
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from model_ops import tp
from model_ops.tp import TPSlice


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def tp_granularity(self, param: str, along_input: bool) -> tuple[int, int]:
        """(logical elements per stored element of `param` along the split dim, logical elements
        a tensor-parallel split must not cut), for a split along the input features (row-parallel)
        or the outputs. Plain weights: (1, 1); a block-quantized format packs and blocks along the
        input features, e.g. (2, 32) for FP4 weights and (32, 32) for their E8M0 scales there."""
        return 1, 1

    def _slice(self, param: str, dim: int, full: int, ranges: tuple[tuple[int, int], ...]) -> TPSlice:
        return TPSlice(dim, full, ranges, *self.tp_granularity(param, dim == 1))


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


class ColumnParallelLinear(Linear):
    """This rank's `out_features / N` output rows; the output stays split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, what: str = "output features"):
        rows = tp.rank_range(out_features, what)
        super().__init__(in_features, rows[1] - rows[0], bias)
        self.full_out, self.rows = out_features, rows

    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice:
        return self._slice(param, 0, self.full_out, (self.rows,))


class RowParallelLinear(Linear):
    """This rank's `in_features / N` input columns (its input is the split output of a
    column-parallel layer or of per-head attention); one all-reduce sums the ranks' products and
    the bias is added once. `reduce=False` leaves the partial sum for the caller to reduce
    together with others (a MoE's routed and shared experts: one all-reduce for both)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True,
                 what: str = "input features"):
        cols = tp.rank_range(in_features, what)
        super().__init__(cols[1] - cols[0], out_features, bias)
        self.full_in, self.cols, self.reduce = in_features, cols, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp.size() == 1:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.weight)
        if self.reduce:
            out = tp.all_reduce(out)
        if self.bias is not None and (self.reduce or tp.rank() == 0):  # a partial sum carries it once
            out = out + self.bias
        return out

    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice | None:
        return None if param == "bias" else self._slice(param, 1, self.full_in, (self.cols,))


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel projections in one weight (gate/up): each split across ranks, so
    a rank's weight is [its gate rows; its up rows] and `split` still separates them."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, what: str = "output features"):
        super().__init__(in_features, [tp.divide(s, what) for s in output_sizes], bias)
        self.full_sizes, self.what = list(output_sizes), what

    def shard_range(self, shard: int) -> tuple[int, int]:
        """This rank's rows of projection `shard`, in that projection's own checkpoint tensor."""
        return tp.rank_range(self.full_sizes[shard], self.what)

    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice:
        if shard is not None:
            return self._slice(param, 0, self.full_sizes[int(shard)], (self.shard_range(int(shard)),))
        # the fused checkpoint tensor whole: this rank's rows of each projection, in order
        offsets = [0, *accumulate(self.full_sizes)]
        ranges = tuple((offsets[i] + a, offsets[i] + b)
                       for i, (a, b) in enumerate(self.shard_range(i) for i in range(len(self.full_sizes))))
        return self._slice(param, 0, offsets[-1], ranges)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v by heads: rank r holds query heads [r H/N, (r+1) H/N) and the KV heads they read.
    With more ranks than KV heads (N > num_kv_heads, N a multiple of it) each rank holds the one
    KV head of its query heads, replicated on the N / num_kv_heads ranks that share it."""

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        n = tp.size()
        heads = tp.divide(num_heads, "num_attention_heads")
        if n > num_kv_heads and n % num_kv_heads or n < num_kv_heads and num_kv_heads % n:
            raise ValueError(f"num_key_value_heads {num_kv_heads} and --tensor-parallel-size {n}: one must divide "
                             f"the other (KV heads are split across ranks, or replicated when there are fewer)")
        kv_heads = max(1, num_kv_heads // n)
        MergedLinear.__init__(self, in_features, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], bias)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.first_kv_head = tp.rank() * num_kv_heads // n
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.what = "attention heads"

    def shard_range(self, shard: int) -> tuple[int, int]:
        if shard == 0:
            return tp.rank_range(self.full_sizes[0], "num_attention_heads")
        start = self.first_kv_head * self.head_dim
        return start, start + self.num_kv_heads * self.head_dim
