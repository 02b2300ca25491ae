"""MXFP4 dense Linear (shared experts, dense MLPs): out = A @ dequantize_mxfp4(weight, scale)^T (+ bias),
A = qdq_mxfp4(x) when the checkpoint quantizes activations, else x; fp32 accumulation.

The weight stays packed (4.25 bits a weight) and is dequantized in registers (see `_mxfp4`);
the activation QDQ happens on the loaded tile. Decode is skinny (M = a few tokens, K = 7168):
the (M, N) tiles alone cannot fill the GPU, so K is split over SPLIT_K programs writing fp32
partials that a second kernel sums in a fixed order (deterministic, no atomics) and finishes
(bias, cast). Every decision is made from shapes, so the call is graph-capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_rocm._mxfp4 import MX_BLOCK, check_mxfp4_weight, load_activation, mxfp4_dot
from kernels_rocm._util import (
    IS_HIP,
    SUPPORTED_DTYPES,
    UPCAST_DOT,
    check_same_device,
    check_tensor,
    dot_precision,
    num_compute_units,
)

PROGRAMS_PER_COMPUTE_UNIT = 4  # split K until the grid has this many programs per SM / CU


@dataclass(frozen=True)
class GemmConfig:
    """Tiles and launch options of one MXFP4 GEMM launch (block_k a multiple of 32)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


def dot_dtype(x_dtype: torch.dtype) -> tl.dtype:
    """Dot operand type: the activation's, except fp32 in the interpreter (bf16 dots are wrong there)."""
    if UPCAST_DOT or x_dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if x_dtype == torch.bfloat16 else tl.float16


def ptx_decode(x_dtype: torch.dtype) -> bool:
    """Decode weights with the CUDA PTX routine: compiled for NVIDIA with bf16 dots. ROCm and the
    interpreter use the portable Triton decode (same values)."""
    return not IS_HIP and not UPCAST_DOT and x_dtype == torch.bfloat16


def choose_split_k(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Power-of-two K split from shapes only: grow while the grid is under
    PROGRAMS_PER_COMPUTE_UNIT programs per SM/CU and every split keeps >= 2 K tiles."""
    k_tiles = triton.cdiv(k, block_k)
    target = PROGRAMS_PER_COMPUTE_UNIT * num_compute_units(device)
    split = 1
    while tiles * split * 2 <= target and k_tiles >= split * 4:
        split *= 2
    return split


# NVIDIA tiles for many rows, largest first: (block_m, block_n, num_warps), block_k 64, 3 stages. H100
# sweep (docs/benchmarks.md section 6, "MXFP4 GEMMs at prefill sizes"): at Kimi TP8's dense MLP
# (N 4608 / K 7168, N 7168 / K 2304) and M = 8,192, 128 x 256 runs 2.3-2.5x the 64 x 64 tiles below
# (216-230 against 92-95 TFLOP/s); a tile is taken while it still gives half an SM's worth of programs.
WIDE_TILES = ((128, 256, 8), (128, 128, 8), (64, 128, 4))


def default_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    if not IS_HIP:  # AMD: never measured with these tiles
        enough = num_compute_units(device) // 2
        for bm, bn, warps in WIDE_TILES:
            if m >= bm and triton.cdiv(m, bm) * triton.cdiv(n, bn) >= enough:
                return GemmConfig(bm, bn, 64, 1, num_warps=warps, num_stages=3)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    block_k = 64 if IS_HIP else 128  # 128 spills a few VGPRs on gfx942
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = choose_split_k(tiles, k, block_k, device)
    return GemmConfig(block_m, block_n, block_k, split, num_warps=4, num_stages=2 if IS_HIP else 3)


@triton.jit
def split_k_range(K, split, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[first, last) K tiles of `split` when cdiv(K, BLOCK_K) tiles are cut into SPLIT_K parts."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = split * per_split
    return first, tl.minimum(first + per_split, k_tiles)


@triton.jit(do_not_specialize=["M"])
def _mxfp4_linear_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K,
    stride_xm: tl.int64, stride_wn: tl.int64, stride_sn: tl.int64, stride_om: tl.int64,
    HAS_BIAS: tl.constexpr, QUANTIZE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX_DECODE: tl.constexpr,
    SCALES_FOLD: tl.constexpr,  # every scale byte of w <= 128 (`foldable_scales`)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 (`mxfp4_dot`)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first, last = split_k_range(K, split, BLOCK_K, SPLIT_K)
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        a = load_activation(
            x_rows + k0 + offs_k[None, :], m_valid[:, None] & (k0 + offs_k < K)[None, :],
            QUANTIZE, BLOCK_M, BLOCK_K, DOT_DTYPE,
        )
        acc = mxfp4_dot(acc, a, w_rows, s_rows, n_valid, k0, K,
                        BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, PTX_DECODE, SCALES_FOLD, EVEN_K)

    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + (split * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om: tl.int64,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[m] = sum over splits (in split order) of part[split, m] (+ bias), cast."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=valid)


def mxfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantize_activations: bool = False,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    fold_scales: bool = False,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, K a multiple of 32), weight uint8 [N, K/2], weight_scale uint8
    E8M0 [N, K/32], bias [N] or None -> [M, N] in x's dtype (or written to `out`).

    `quantize_activations` runs x through MXFP4 quantize-dequantize ("even" scale) first, as a
    checkpoint with dynamic MXFP4 input_tensors expects. `config` overrides the tile choice
    (benchmarks); by default it follows from the shapes. `fold_scales`: every E8M0 byte of weight_scale is
    <= 128 (`_mxfp4.foldable_scales`, checked once by the layer after loading): each scale is then applied
    in the weight decode's multiply (mxfp4_dot). False is right for any weights.
    """
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    m, k = x.shape
    if k % MX_BLOCK:
        raise ValueError(f"x has shape {tuple(x.shape)}: K must be a multiple of {MX_BLOCK} (MXFP4 blocks)")
    check_tensor("weight", weight, 2)
    check_tensor("weight_scale", weight_scale, 2)
    check_mxfp4_weight("weight", weight, weight_scale, "weight_scale", k)
    n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, 1, SUPPORTED_DTYPES)
        if bias.shape[0] != n:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [{n}] (weight's output features)")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a [{m}, {n}] {x.dtype} tensor contiguous in its last dim, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    check_same_device(x=x, weight=weight, weight_scale=weight_scale, bias=bias, out=out)
    if m == 0:
        return out

    cfg = config or default_config(m, n, k, x.device)
    part = (torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
            if cfg.split_k > 1 else out)
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _mxfp4_linear_kernel[grid](
        x, weight, weight_scale, bias_arg, out, part,
        m, n, k,
        x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, QUANTIZE=quantize_activations, SPLIT_K=cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype), PTX_DECODE=ptx_decode(x.dtype),
        SCALES_FOLD=fold_scales, EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](
            part, bias_arg, out, m, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK=block,
        )
    return out
