"""Linear layers. MergedLinear holds several checkpoint projections (q/k/v, gate/up) in one
weight so a step runs one GEMM instead of several; the loader fills it shard by shard.

Tensor parallelism (Megatron-style, model_ops.tp): a column-parallel layer holds this rank's
rows of the output features and leaves its output split (the next op is per head, or a
row-parallel layer); a row-parallel layer holds this rank's columns of the input features and
sums the ranks' partial products with one all-reduce. How a layer is split is its
`LinearSharding` (None: replicated), kept apart from how its weight is stored, so the packed
MXFP4 layer that replaces a float one (model_ops.quant.mxfp4_layers) takes the float layer's
sharding and slices and reduces alike. At -tp 1 every parallel layer is exactly the plain one.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import accumulate
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from model_ops import tp
from model_ops.activation import silu_and_mul
from model_ops.deferred import weight_device
from model_ops.layernorm import RMSNorm
from model_ops.tp import TPSlice


@dataclass(frozen=True)
class LinearSharding:
    """This rank's part of a linear layer. Column-parallel (`along_input` False): rows
    `ranges[i]` of projection i's `full_sizes[i]` outputs (one projection unless merged); the
    output stays split. Row-parallel (True): input columns `ranges[0]` of `full_sizes[0]`; the
    product is a partial sum, all-reduced here unless `reduce` is False (the caller reduces it
    together with others: a MoE's routed and shared experts share one all-reduce)."""
    along_input: bool
    full_sizes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    reduce: bool = True

    def tp_slice(self, param: str, shard: Hashable | None, pack: int = 1, block: int = 1) -> TPSlice | None:
        """What this rank loads of the checkpoint tensor filling `param` (or its `shard`, a
        projection index); `pack` / `block` are the storage format's (TPSlice)."""
        if self.along_input:
            return None if param == "bias" else TPSlice(1, self.full_sizes[0], self.ranges[:1], pack, block)
        if shard is not None:
            return TPSlice(0, self.full_sizes[int(shard)], (self.ranges[int(shard)],), pack, block)
        # the (fused) checkpoint tensor whole: this rank's rows of each projection, in order
        offsets = list(accumulate(self.full_sizes, initial=0))
        return TPSlice(0, offsets[-1], tuple((o + a, o + b) for o, (a, b) in zip(offsets, self.ranges)), pack, block)


def sharded_output(sharding: LinearSharding | None, product: Callable[[torch.Tensor | None], torch.Tensor],
                   bias: torch.Tensor | None) -> torch.Tensor:
    """A layer's output from `product(bias)`, this rank's GEMM (adding `bias` when given): a
    row-parallel layer on several ranks sums the ranks' partial products and adds the bias once."""
    if sharding is None or not sharding.along_input or tp.size() == 1:
        return product(bias)
    out = product(None)
    if sharding.reduce:
        out = tp.all_reduce(out)
    if bias is not None and (sharding.reduce or tp.rank() == 0):  # a partial sum carries it once
        out = out + bias
    return out


@functools.cache
def _gemv() -> ModuleType | None:
    """kernels_rocm.skinny_gemm on NVIDIA GPUs with triton (None: the GEMM library everywhere)."""
    if importlib.util.find_spec("triton") is None or torch.version.hip is not None:
        return None  # the GEMV kernel never ran on AMD hardware: ROCm keeps hipBLASLt
    from kernels_rocm import skinny_gemm

    return skinny_gemm


def _gemv_for(x: torch.Tensor, weight: torch.Tensor, fp32_out: bool = False) -> ModuleType | None:
    """The GEMV kernel module when it takes this product: decode-sized (at most 4 rows: batch 1-4,
    or one sequence's verify of 3 drafts; up to its 8 with an fp32 output, where the alternative
    also copies the weight to fp32), 16-bit, on an NVIDIA GPU, with unit last strides."""
    if (x.dim() == 2 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1
            and (kernels := _gemv()) is not None
            and x.shape[0] <= (kernels.MAX_M if fp32_out else kernels.FASTER_THAN_CUBLAS_UP_TO_M)):
        return kernels
    return None


def gemv_weight(weight: torch.Tensor) -> bool:
    """Whether decode-sized products with `weight` run the GEMV kernel (16-bit, on an NVIDIA GPU):
    a layer keeps a copy of a weight in the kernel's layout only where this holds."""
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and _gemv() is not None


PER_HEAD_GEMV_MAX_HEADS = 16  # H200, CUDA graphs (docs/benchmarks.md section 10): 8 heads 1.6-2.4 us vs bmm's
# 2.5-4.8; at 64 heads (Kimi at TP1) the kernel's many small programs lose (W_UK^T 10.6 us vs 3.5)


def per_head_gemv(weight: torch.Tensor) -> bool:
    """Whether dense_per_head runs the GEMV kernel for this [H, N, K] weight (a layer keeps a
    copy in the kernel's layout only where it does)."""
    return gemv_weight(weight) and weight.shape[0] <= PER_HEAD_GEMV_MAX_HEADS


def dense_per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] times each head's weight [H, N, K] transposed -> [T, H, N] (MLA's absorbed
    W_UK / W_UV products). Up to the GEMV kernel's 8 rows and 16 heads on an NVIDIA GPU with a
    16-bit weight whose rows are contiguous: one launch reading x through its strides, ~1 MB of
    weight a layer a Kimi-K2.5 TP8 rank, where cuBLAS's bmm spent 4.7 and 2.8 us of latency
    (H200); everything else, and every CPU product (the exact reference), is torch.bmm."""
    if (x.is_cuda and x.dtype == weight.dtype and per_head_gemv(weight) and x.shape[0] <= _gemv().MAX_M
            and x.stride(-1) == 1 and weight.stride(-1) == 1):
        return _gemv().skinny_bmm(x, weight)
    return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b). Decode-sized products on an NVIDIA GPU run the GEMV kernel, 5-13% faster than
    cuBLAS on every Llama-3.1-8B projection and the LM head on an H100 (docs/benchmarks.md
    section 8); everything else, and every CPU product (the exact reference), is F.linear."""
    if bias is None and (kernels := _gemv_for(x, weight)) is not None:
        return kernels.skinny_gemm(x, weight)
    return F.linear(x, weight, bias)


def dense_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T summed and returned in fp32, as F.linear(x.float(), W.float()) computes it (a MoE
    router's logits, which every reference takes in fp32). Decode-sized 16-bit products on an
    NVIDIA GPU run the GEMV kernel with an fp32 output: no fp32 copy of W each step (that copy
    and cuBLAS's fp32 GEMV took ~16 us of a Kimi-K2.5 layer at batch 1 on an H200). Larger ones
    there take cuBLAS's 16-bit GEMM with an fp32 output (`torch.mm(out_dtype=)`), as SGLang's
    dsv3_router_gemm takes bf16 to fp32 logits: its tensor-core sums are less exact than fp32 SIMT
    ones (H100: 8.7e-6 of the largest logit at 8,192 rows against 4e-7), far below bf16's ~1e-3. The
    fp32 GEMM of fp32 copies ran at SIMT speed: 0.9 ms of a Kimi TP8 rank's MoE layer per 8,192
    prompt tokens on an H100 (docs/benchmarks.md section 6), and copied W to fp32 every step."""
    if (kernels := _gemv_for(x, weight, fp32_out=True)) is not None:
        return kernels.skinny_gemm(x, weight, out_dtype=torch.float32)
    if x.dim() == 2 and gemv_weight(weight) and x.dtype == weight.dtype:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


def dense_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x W^T for a merged [gate; up] weight. Where `dense` takes the GEMV
    kernel, SwiGLU runs in its epilogue (same rounding, one kernel fewer a layer)."""
    if (kernels := _gemv_for(x, weight)) is not None:
        return kernels.skinny_gemm(x, weight, swiglu=True)
    return silu_and_mul(dense(x, weight))


def dense_after_rms_norm(x: torch.Tensor, norm: RMSNorm, layer: nn.Module) -> torch.Tensor:
    """layer(norm(x)). Where `dense` takes the GEMV kernel and `layer` is a bias-free float Linear
    (DeepSeek's q_a_layernorm -> q_b_proj), the norm runs as the kernel's prologue, rounded as the
    norm kernel rounds (its sum of squares in another order): one launch fewer a layer. Any
    other layer (a quantized one) or size, and every CPU product, runs the norm, then the layer."""
    if isinstance(layer, Linear) and layer.bias is None and (kernels := _gemv_for(x, layer.weight)) is not None:
        return sharded_output(layer.sharding, lambda _: kernels.skinny_gemm(x, layer.weight, norm_weight=norm.weight,
                                                                            norm_eps=norm.eps), None)
    return layer(norm(x))


class Linear(nn.Module):
    """y = x W^T + b; replicated on every rank unless `sharding` says otherwise (the parallel
    subclasses below compute it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 sharding: LinearSharding | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.sharding = sharding
        # on the meta device while a quantization config may still replace this layer (model_ops.deferred)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=weight_device()), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=weight_device()), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sharded_output(self.sharding, lambda bias: dense(x, self.weight, bias), self.bias)

    # TPSharded (model_ops.tp)
    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice | None:
        return None if self.sharding is None else self.sharding.tp_slice(param, shard)


class MergedLinear(Linear):
    """Output rows are the concatenation of `output_sizes` projections (shard 0 first)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 sharding: LinearSharding | None = None):
        super().__init__(in_features, sum(output_sizes), bias, sharding)
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
        super().__init__(in_features, rows[1] - rows[0], bias, LinearSharding(False, (out_features,), (rows,)))


class RowParallelLinear(Linear):
    """This rank's `in_features / N` input columns (its input is the split output of a
    column-parallel layer or of per-head attention); one all-reduce sums the ranks' products and
    the bias is added once. `reduce=False` leaves the partial sum for the caller to reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True,
                 what: str = "input features"):
        cols = tp.rank_range(in_features, what)
        super().__init__(cols[1] - cols[0], out_features, bias, LinearSharding(True, (in_features,), (cols,), reduce))


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel projections in one weight (gate/up): each split across ranks, so
    a rank's weight is [its gate rows; its up rows] and `split` still separates them."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, what: str = "output features"):
        ranges = tuple(tp.rank_range(s, what) for s in output_sizes)
        super().__init__(in_features, [b - a for a, b in ranges], bias,
                         LinearSharding(False, tuple(output_sizes), ranges))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] projection (this rank's columns of the intermediate)."""
        if self.bias is not None:
            return silu_and_mul(self(x))
        return dense_silu_and_mul(x, self.weight)


class QKVParallelLinear(MergedLinear):
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
        first_kv = tp.rank() * num_kv_heads // n * head_dim
        kv = (first_kv, first_kv + kv_heads * head_dim)
        full = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        super().__init__(in_features, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], bias,
                         LinearSharding(False, full, (tp.rank_range(full[0], "num_attention_heads"), kv, kv)))
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
