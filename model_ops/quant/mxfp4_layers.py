"""Layers that hold Quark MXFP4 weights packed (about 4.25 bits a weight) and run on them.

Storage is the checkpoint's, untouched (MXFP4_CONTRACT.md): a Linear keeps `weight` uint8
[N, K/2] and `weight_scale` uint8 E8M0 [N, K/32]; routed experts stack them per expert,
`w13` [E, 2I, H/2] (gate rows then up rows) with `w13_scale` [E, 2I, H/32], and `w2` [E, H, I/2]
with `w2_scale` [E, H, I/32]. Each is a plain tensor cut along 32-element blocks only, so a
tensor-parallel split on block boundaries is a slice of rows or of whole scale columns. A packed
layer takes the sharding of the float layer it replaces (LinearSharding, ExpertsSharding) and
adds its format's grain: a split along the input features must fall on a 32-element block
(model_ops.tp.TPSlice refuses, naming the parameter, a -tp that would cut one).

`quantize_activations` is the checkpoint's dynamic MXFP4 `input_tensors`: every GEMM input is
MXFP4-quantized per 32-element block (Quark's "even" scale) before the product, as the model was
evaluated; off, the same weights run with unquantized activations (W4A16).

On a GPU the Triton kernels of kernels_rocm run (the activation QDQ fused in, the weights
dequantized in registers); on CPU, and wherever those kernels are absent, the reference below
dequantizes in PyTorch. The reference is the kernels' oracle. Routed experts may instead run
aiter's fused MoE (ROCm gfx942/gfx950, `--moe-backend`; never executed on AMD hardware, see
docs/rocm.md), which reads its own shuffled layout: the loaded tensors are rearranged once, in
place, by `process_weights_after_loading`.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from kernels_rocm.aiter_ops import AiterMXFP4MoE, Platform, aiter_moe_problem, aiter_unavailable_reason, detect_platform
from model_ops.activation import silu_and_mul
from model_ops.attention.backends import check_aiter_available, check_backend_choice
from model_ops.linear import LinearSharding, sharded_output
from model_ops.moe import ExpertsSharding
from model_ops.quant.mxfp4 import BLOCK, E8M0_NAN, dequantize_mxfp4, qdq_mxfp4
from model_ops.tp import TPSlice

# (x [M, K], weight, weight_scale, bias, *, quantize_activations) -> [M, N]
MXFP4LinearFn = Callable[..., torch.Tensor]
# (x [T, H], w13, w13_scale, w2, w2_scale, topk_weights [T, K], topk_ids [T, K], *, quantize_activations) -> [T, H]
MXFP4ExpertsFn = Callable[..., torch.Tensor]


def mxfp4_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None, *, quantize_activations: bool) -> torch.Tensor:
    a = qdq_mxfp4(x) if quantize_activations else x
    return F.linear(a, dequantize_mxfp4(weight, weight_scale, x.dtype), bias)


def fused_moe_mxfp4_reference(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                              w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                              quantize_activations: bool) -> torch.Tensor:
    """One SwiGLU per expert that received tokens on dequantized weights, the intermediate
    re-quantized like the input; a token's K expert outputs summed in fp32. Reads the routing on
    the host: not graph-capturable."""
    a = qdq_mxfp4(x) if quantize_activations else x
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        h = silu_and_mul(F.linear(a[token], dequantize_mxfp4(w13[expert], w13_scale[expert], x.dtype)))
        if quantize_activations:
            h = qdq_mxfp4(h)
        y = F.linear(h, dequantize_mxfp4(w2[expert], w2_scale[expert], x.dtype))
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def select_mxfp4_linear_impl(device: torch.device) -> MXFP4LinearFn:
    """kernels_rocm.mxfp4_linear on a GPU where that module exists, else the reference."""
    if device.type != "cpu" and importlib.util.find_spec("kernels_rocm.mxfp4_linear") is not None:
        from kernels_rocm.mxfp4_linear import mxfp4_linear

        return mxfp4_linear
    return mxfp4_linear_reference


def choose_mxfp4_experts_backend(preference: str, platform: Platform, hidden_size: int, intermediate_size: int,
                                 quantize_activations: bool) -> str:
    """The one switch for MXFP4 routed experts (--moe-backend): "torch" (the reference), "triton"
    (kernels_rocm.mxfp4_moe) or "aiter". auto: the reference on CPU; on a GPU aiter where it runs
    (ROCm gfx942/gfx950, aiter importable) and takes these experts (aiter_moe_problem), else Triton."""
    check_backend_choice(preference, "--moe-backend")
    if preference == "aiter":
        check_aiter_available("--moe-backend", platform)
        problem = aiter_moe_problem(hidden_size, intermediate_size, quantize_activations)
        if problem is not None:
            raise ValueError(f"--moe-backend aiter cannot run these MXFP4 experts: {problem}; use auto or triton")
        return "aiter"
    if preference == "auto":
        if platform.device_type == "cpu":
            return "torch"
        aiter_runs = aiter_unavailable_reason(platform) is None
        if aiter_runs and aiter_moe_problem(hidden_size, intermediate_size, quantize_activations) is None:
            return "aiter"
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    return preference


def mxfp4_experts_backend(preference: str, hidden_size: int, intermediate_size: int,
                          quantize_activations: bool) -> str:
    """choose_mxfp4_experts_backend for experts built on the default device (this rank's
    `intermediate_size`): what MXFP4Experts will run, known before it is built."""
    return choose_mxfp4_experts_backend(preference, detect_platform(torch.get_default_device()), hidden_size,
                                        intermediate_size, quantize_activations)


def mxfp4_experts_impl(backend: str) -> MXFP4ExpertsFn:
    """The function behind "torch" or "triton" (aiter is a stateful adapter: AiterMXFP4MoE)."""
    if backend == "triton":
        from kernels_rocm.mxfp4_moe import fused_moe_mxfp4

        return fused_moe_mxfp4
    return fused_moe_mxfp4_reference


def _bind_scale_fold(impl: Callable[..., torch.Tensor], *scales: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A Triton impl bound to `fold_scales`: whether every E8M0 byte of the loaded scales lets the
    GEMMs apply it in the weight decode's one multiply (kernels_rocm._mxfp4.foldable_scales). Checked
    once, after loading (it reads the scales back); a kernel argument because it must be constant
    inside a captured graph."""
    from kernels_rocm._mxfp4 import foldable_scales

    return functools.partial(impl, fold_scales=foldable_scales(*scales))


def _packed_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


def check_mxfp4_tensor(param: str, tensor: torch.Tensor) -> None:
    """A checkpoint tensor for a packed parameter: uint8 bytes, and no NaN (255) scale byte."""
    if tensor.dtype != torch.uint8:
        raise ValueError(f"is {tensor.dtype} but {param} holds packed MXFP4 bytes (uint8): the quantization config "
                         "says this layer is MXFP4 and the checkpoint disagrees")
    if param.endswith("scale"):
        nan = (tensor == E8M0_NAN).nonzero()
        if len(nan):
            raise ValueError(f"holds the E8M0 NaN byte 255 at index {tuple(nan[0].tolist())} "
                             f"({len(nan)} of {tensor.numel()} scales): the checkpoint is corrupt")


def _check_block_multiple(what: str, size: int) -> None:
    if size % BLOCK:
        raise ValueError(f"MXFP4 {what} {size} is not a multiple of {BLOCK}: scales cover blocks of {BLOCK} "
                         "input elements")


def _input_grain(param: str) -> tuple[int, int]:
    """(logical input elements per stored element, block) of a packed weight or its scales along
    the input features: 2 FP4 values a byte, one E8M0 scale per 32; both cut only between blocks."""
    return (BLOCK if param.endswith("scale") else 2), BLOCK


class MXFP4Linear(nn.Module):
    """y = (qdq(x) if quantize_activations else x) @ dequantize(weight, weight_scale).T + bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quantize_activations: bool = True,
                 sharding: LinearSharding | None = None):
        """`in_features` / `out_features` are this rank's; `sharding` the float layer's (None: replicated)."""
        super().__init__()
        row_parallel = sharding is not None and sharding.along_input
        _check_block_multiple("input size", sharding.full_sizes[0] if row_parallel else in_features)
        self.in_features, self.out_features = in_features, out_features
        self.quantize_activations, self.sharding = quantize_activations, sharding
        self.weight = _packed_param(out_features, in_features // 2)
        self.weight_scale = _packed_param(out_features, in_features // BLOCK)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.impl = select_mxfp4_linear_impl(torch.get_default_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def product(bias: torch.Tensor | None) -> torch.Tensor:
            out = self.impl(x.reshape(-1, self.in_features), self.weight, self.weight_scale, bias,
                            quantize_activations=self.quantize_activations)
            return out.view(*x.shape[:-1], self.out_features)

        return sharded_output(self.sharding, product, self.bias)

    # ProcessedAfterLoading (atom_like.loader.weights)
    def process_weights_after_loading(self) -> None:
        if self.impl is not mxfp4_linear_reference:  # the Triton kernel
            self.impl = _bind_scale_fold(self.impl, self.weight_scale.data)

    # TPSharded (model_ops.tp): rows are free to split, input columns only between blocks
    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice | None:
        if self.sharding is None:
            return None
        return self.sharding.tp_slice(param, shard, *(_input_grain(param) if self.sharding.along_input else (1, 1)))

    # CheckedParameters (atom_like.loader.weights)
    def check_tensor(self, param: str, tensor: torch.Tensor) -> None:
        if param != "bias":
            check_mxfp4_tensor(param, tensor)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"quantize_activations={self.quantize_activations}")


class MXFP4MergedLinear(MXFP4Linear):
    """MergedLinear's packed counterpart: output rows of `output_sizes` projections, shard 0 first;
    weight, weight_scale and bias are all cut by output rows."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quantize_activations: bool = True, sharding: LinearSharding | None = None):
        super().__init__(in_features, sum(output_sizes), bias, quantize_activations, sharding)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    # ShardedParameters (atom_like.loader.weights)
    def weight_shards(self, param: str) -> range:
        return range(len(self.output_sizes))

    def shard_view(self, param: str, shard: int) -> torch.Tensor:
        return getattr(self, param).data[self.shard_rows(shard)]

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.output_sizes, dim=-1)


class MXFP4Experts(nn.Module):
    """FusedExperts' packed counterpart, with the same call: (x, topk_weights, topk_ids) -> [T, H].
    Like FusedExperts it takes the full `intermediate_size` and holds this rank's part of it.
    `backend`: --moe-backend (choose_mxfp4_experts_backend, on this rank's part)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, quantize_activations: bool = True,
                 backend: str = "auto"):
        super().__init__()
        _check_block_multiple("hidden size (the gate/up input)", hidden_size)
        _check_block_multiple("moe_intermediate_size (the down_proj input)", intermediate_size)
        self.sharding = ExpertsSharding.split(intermediate_size)
        self.num_experts, self.intermediate_size = num_experts, self.sharding.size
        self.quantize_activations = quantize_activations
        local = self.intermediate_size
        self.w13 = _packed_param(num_experts, 2 * local, hidden_size // 2)
        self.w13_scale = _packed_param(num_experts, 2 * local, hidden_size // BLOCK)
        self.w2 = _packed_param(num_experts, hidden_size, local // 2)
        self.w2_scale = _packed_param(num_experts, hidden_size, local // BLOCK)
        self.backend = mxfp4_experts_backend(backend, hidden_size, local, quantize_activations)
        # aiter runs on its own layout of these tensors, made once after loading (process_weights_after_loading)
        self.aiter = AiterMXFP4MoE() if self.backend == "aiter" else None
        self.impl = mxfp4_experts_impl(self.backend)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.aiter is not None:
            return self.aiter(x, topk_weights, topk_ids)
        return self.impl(x, self.w13, self.w13_scale, self.w2, self.w2_scale, topk_weights, topk_ids,
                         quantize_activations=self.quantize_activations)

    # TPSharded (model_ops.tp): w13 splits along its outputs, w2 along its input (between blocks)
    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice:
        return self.sharding.tp_slice(param, shard, *(_input_grain(param) if param.startswith("w2") else (1, 1)))

    # ProcessedAfterLoading (atom_like.loader.weights)
    def process_weights_after_loading(self) -> None:
        if self.aiter is not None:
            self.aiter.shuffle_in_place(self.w13.data, self.w13_scale.data, self.w2.data, self.w2_scale.data)
        elif self.backend == "triton":
            self.impl = _bind_scale_fold(self.impl, self.w13_scale.data, self.w2_scale.data)

    # ShardedParameters (atom_like.loader.weights): one shard per expert and projection, "3.up_proj".
    def weight_shards(self, param: str) -> list[str]:
        projections = ("down_proj",) if param.startswith("w2") else ("gate_proj", "up_proj")
        return [f"{e}.{p}" for e in range(self.num_experts) for p in projections]

    def shard_view(self, param: str, shard: Hashable) -> torch.Tensor:
        expert, projection = str(shard).split(".")
        tensor = getattr(self, param).data[int(expert)]
        if projection == "down_proj":
            return tensor
        return tensor[:self.intermediate_size] if projection == "gate_proj" else tensor[self.intermediate_size:]

    # CheckedParameters (atom_like.loader.weights)
    def check_tensor(self, param: str, tensor: torch.Tensor) -> None:
        check_mxfp4_tensor(param, tensor)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}, "
                f"quantize_activations={self.quantize_activations}, backend={self.backend}")
