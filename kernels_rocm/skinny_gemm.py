"""GEMV-style GEMM for decode: y [M, N] = x [M, K] @ w [N, K]^T for M = 1..8 (one token a
sequence at batch 1, or a speculative verify of up to 8 rows).

At these sizes a projection is a weight read: every weight is used M times, so the work is
M multiply-adds per weight loaded. A GEMM library tiles M to 64 or 128 rows (almost all padding
here) and, for narrow N, launches too few tiles to keep every SM pulling weights; on an H100
cuBLAS reaches 51-60% of copy bandwidth on the Llama-3.1-8B qkv and o_proj
(docs/benchmarks.md section 8). Here there is no tl.dot: each program owns BLOCK_N weight rows
and walks K. Every lane of every warp loads one 16-byte vector of each of its rows per step
(so a step covers K in LANES x VEC elements, 32 x num_warps lanes on NVIDIA), multiplies it
with the matching vector of each of the M rows of x and sums the vector in its registers; the
partial sums stay per lane until the end, when one cross-lane reduction finishes them. Nothing
crosses lanes inside the K loop, and the weight tile and the x tile share one register layout
(see the kernel), so the loop is 16-byte loads, conversions to fp32 and FMAs only.

One launch, no atomics, no workspace: fp32 accumulation, the result written once in x's dtype,
in a fixed summation order (deterministic run to run). Every decision is made from shapes, so
the call is CUDA/HIP-graph capturable. For M > 8 use F.linear: the split-K tl.dot kernel this
replaced beat cuBLAS only on the LM head at M = 16 (3%) on an H100.

skinny_bmm is the same kernel over a grid axis of batch entries with their own strides: MLA's
absorbed per-head products (W_UK, W_UV; model_ops.linear.dense_per_head), ~1 MB of weight a
Kimi-K2.5 TP8 rank where each cuBLAS bmm launch cost 3-5 us of latency on an H200.

model_ops.linear.dense takes it on NVIDIA GPUs for M <= FASTER_THAN_CUBLAS_UP_TO_M, where
ci/bench_roofline.py (part `gemm`, a sweep of `GemvConfig`s against cuBLAS on the 8B projections)
measured it faster; never run on AMD hardware, so ROCm keeps its GEMM library.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import (
    INTERPRET,
    IS_HIP,
    SUPPORTED_DTYPES,
    check_dim,
    check_same_device,
    check_tensor,
    num_compute_units,
)
from kernels_rocm.rms_norm import rms_scale

MAX_M = 8  # rows of x a launch takes; beyond, accumulators (BLOCK_M x BLOCK_N a lane) crowd registers
NUM_WARPS = (1, 2, 4, 8)
PRELOAD_BYTES = tl.constexpr(128)  # a lane's first-step weights held across the PDL wait: 8 rows of 16 bytes


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: `block_n` weight rows a program (a power of two); `num_warps` warps, each
    lane loading one 16-byte vector of every row per K step (so the step is warp size x
    num_warps x 16 bytes of each row). Registers grow with block_n x the padded M: keep
    block_n x next_power_of_2(M) <= 64 (ci/compile_kernels.py checks for spills). There is no
    num_stages: Triton's software pipeliner leaves these loads alone (they feed no tl.dot; the
    sm_90 SASS is the same for 1 and 3 stages), so latency is hidden by several programs an SM.
    `vector_bytes` below 16 shortens the step for rows that would leave lanes idle (skinny_bmm)."""

    block_n: int = 8
    num_warps: int = 4
    vector_bytes: int = 16  # what a lane loads of a row per K step; less for rows too short to fill the lanes


def _rows_a_program(programs: Callable[[int], int], compute_units: int, min_rows: int = 1) -> int:
    """4 weight rows a program, halved (down to `min_rows`) while `programs(rows)` would leave SMs
    without a program."""
    rows = 4
    while rows > min_rows and programs(rows) < compute_units:
        rows //= 2
    return rows


def default_config(m: int, n: int = 0, compute_units: int = 0, min_rows: int = 1) -> GemvConfig:
    """The launch shape measured best across the Llama-3.1-8B projections (qkv, o_proj, gate_up,
    down, lm_head) on an H100 (docs/benchmarks.md section 8, sweep of 12-20 configs): 4 rows a
    program, 8 warps at M <= 2 (within 1.6% of each shape's best) and 2 warps from M = 3 (within
    2.1% at M = 4). Four rows keep >= 1,000 programs on every one of those shapes; for N outputs
    so few that 4 rows a program would leave SMs without a program (a MoE router's 384 experts:
    96 programs on 132 SMs), fewer rows, down to `min_rows` (2 with the SwiGLU epilogue).
    Kimi-K2.5's TP8 projections (H200 sweep, section 10) have fewer programs at M = 4 and want
    more warps there: 4 from 3 programs an SM (fused q_a/kv_a, 528: 16.4 us against 20.4 with 2),
    8 below (q_b 384: 7.5 against 8.6; the router: 9.0 against 13.9); the 8B shapes keep 2."""
    rows = _rows_a_program(lambda r: triton.cdiv(n, r), compute_units, min_rows)
    if m <= 2:
        return GemvConfig(block_n=rows, num_warps=8)
    programs = triton.cdiv(n, rows)
    warps = 2 if programs >= 6 * compute_units else 4 if programs >= 3 * compute_units else 8
    return GemvConfig(block_n=rows, num_warps=warps)


FASTER_THAN_CUBLAS_UP_TO_M = 4  # same sweep: faster than cuBLAS on all five shapes at M 1, 2, 4; slower on all at 8


@triton.jit
def _step_sum(w, x_ptrs, x_mask, norm_weight_ptr, k, rstd, dtype: tl.constexpr, NORM: tl.constexpr, k_valid=None):
    """One K step's products summed over the vector: [LANES, BLOCK_N, BLOCK_M] in fp32 (under NORM x
    is normalized as it is loaded, with the norm weights at offsets `k`, masked by `k_valid` in a
    partial step)."""
    x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
    if NORM:
        if k_valid is None:
            norm_weight = tl.load(norm_weight_ptr + k)
        else:
            norm_weight = tl.load(norm_weight_ptr + k, mask=k_valid, other=0.0)
        x = rms_scale(x, rstd, norm_weight, dtype).to(tl.float32)
    return tl.sum(x * w.to(tl.float32), axis=3)


@triton.jit
def _steps_from(acc, K_START: tl.constexpr, k_full, K, w_ptrs, x_ptrs, m_valid, rk, norm_weight_ptr, rstd,
                dtype: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus the whole K steps from K_START to k_full, then the partial step to K, if any."""
    for k0 in range(K_START, k_full, BLOCK_K):
        acc += _step_sum(tl.load(w_ptrs + k0), x_ptrs + k0, m_valid, norm_weight_ptr, rk + k0, rstd, dtype, NORM)
    if k_full < K:
        k_valid = rk < K - k_full
        acc += _step_sum(tl.load(w_ptrs + k_full, mask=k_valid, other=0.0), x_ptrs + k_full, m_valid & k_valid,
                         norm_weight_ptr, rk + k_full, rstd, dtype, NORM, k_valid)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, norm_weight_ptr, norm_eps, M, N, K,
    stride_xm: tl.int64, stride_wn: tl.int64, stride_ym: tl.int64,
    stride_xb: tl.int64, stride_wb: tl.int64, stride_yb: tl.int64,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr,
    SWIGLU: tl.constexpr, BATCHED: tl.constexpr, NORM: tl.constexpr, EARLY_WITHOUT_PDL: tl.constexpr,
    PDL: tl.constexpr,
):
    # Tiles are [LANES, BLOCK_N or 1, 1 or BLOCK_M, VEC] with k = lane * VEC + v. Only the VEC axis
    # is contiguous in memory, so Triton gives it to one lane (a 16-byte vector), spreads the lane
    # axis (listed first) over lanes then warps exactly (LANES = warp size x num_warps), and keeps
    # the N and M axes in every lane's registers: the x and w loads get one layout, and the
    # broadcast product and the VEC sum never leave the lane.
    # EARLY: the first K step's weights are loaded before the PDL wait. No kernel of a step writes
    # weights, so that load may overlap the previous kernel's tail instead of following it (most of
    # Kimi-K2.5 TP8's projections, K <= 2,048 at 8 warps, are one step: their whole read). The rows'
    # vectors are then live across the wait (4 registers a 16-byte vector), hence only for programs
    # of few rows and accumulators (the default shapes; the widest of bench_roofline's sweep would
    # spill), and only with PDL, which can overlap it (or EARLY_WITHOUT_PDL: the CPU interpreter runs
    # that form so that CI checks it); elsewhere the kernel is as it was. Everything that reads x or
    # writes y stays after the wait.
    ROW_STEP_BYTES: tl.constexpr = VEC * w_ptr.dtype.element_ty.primitive_bitwidth // 8
    EARLY: tl.constexpr = ((PDL or EARLY_WITHOUT_PDL) and BLOCK_N * ROW_STEP_BYTES <= PRELOAD_BYTES
                           and BLOCK_N * BLOCK_M <= 16)
    if not EARLY:
        wait_for_previous_kernel(PDL)
    BLOCK_K: tl.constexpr = LANES * VEC
    if BATCHED:  # grid axis 1: skinny_bmm's batch entry (a head); skinny_gemm's code stays as it was measured
        batch = tl.program_id(1).to(tl.int64)
        x_ptr += batch * stride_xb
        w_ptr += batch * stride_wb
        y_ptr += batch * stride_yb
    if SWIGLU:
        # N outputs from 2N weight rows [gate; up]: a program's rows alternate gate j, up j, so the
        # epilogue finds each output's two dot products side by side
        OUT_N: tl.constexpr = BLOCK_N // 2
        cols = tl.program_id(0) * OUT_N + tl.arange(0, BLOCK_N) // 2
        rows = tl.minimum(cols, N - 1).to(tl.int64) + (tl.arange(0, BLOCK_N) % 2) * N
    else:
        OUT_N: tl.constexpr = BLOCK_N
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(cols, N - 1).to(tl.int64)  # rows past N re-read row N - 1: no mask on the weight loads
    rm = tl.arange(0, BLOCK_M)
    rk = (tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :])[:, None, None, :]
    w_ptrs = w_ptr + rows[None, :, None, None] * stride_wn + rk  # [LANES, BLOCK_N, 1, VEC]
    x_ptrs = x_ptr + rm[None, None, :, None].to(tl.int64) * stride_xm + rk  # [LANES, 1, BLOCK_M, VEC]
    m_valid = (rm < M)[None, None, :, None]
    k_full = (K // BLOCK_K) * BLOCK_K  # written so that K - k_full keeps K's divisibility (vector masks)
    if EARLY:
        w_first = tl.load(w_ptrs, mask=rk < K, other=0.0)
        wait_for_previous_kernel(PDL)
    rstd = 1.0  # the norm's reciprocal RMS, [1, 1, BLOCK_M, 1] under NORM
    if NORM:
        # RMSNorm prologue: every program reads its x rows whole once more (M x K, from L2) for their
        # sums of squares, then normalizes each x vector as it is loaded, rounded as
        # kernels_rocm.rms_norm rounds (normalized row to x's dtype, times the weight, again)
        squares = tl.zeros((LANES, 1, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, k_full, BLOCK_K):
            x = tl.load(x_ptrs + k0, mask=m_valid, other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=3)
        if k_full < K:
            x = tl.load(x_ptrs + k_full, mask=m_valid & (rk < K - k_full), other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=3)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + norm_eps)[None, :, :, None]  # [1, 1, BLOCK_M, 1]
    acc = tl.zeros((LANES, BLOCK_N, BLOCK_M), dtype=tl.float32)
    dtype_x: tl.constexpr = x_ptr.dtype.element_ty
    if EARLY:
        if k_full > 0:  # w_first is step 0, whole
            acc += _step_sum(w_first, x_ptrs, m_valid, norm_weight_ptr, rk, rstd, dtype_x, NORM)
            acc = _steps_from(acc, BLOCK_K, k_full, K, w_ptrs, x_ptrs, m_valid, rk, norm_weight_ptr, rstd, dtype_x,
                              NORM, BLOCK_K)
        else:  # K under one step: w_first is the whole (masked) row
            k_valid = rk < K
            acc += _step_sum(w_first, x_ptrs, m_valid & k_valid, norm_weight_ptr, rk, rstd, dtype_x, NORM, k_valid)
    else:
        acc = _steps_from(acc, 0, k_full, K, w_ptrs, x_ptrs, m_valid, rk, norm_weight_ptr, rstd, dtype_x, NORM, BLOCK_K)
    out = tl.sum(acc, axis=0)  # [BLOCK_N, BLOCK_M]: the one cross-lane reduction
    dtype = y_ptr.dtype.element_ty
    if SWIGLU:
        # rounded as the unfused path rounds: the GEMM's outputs, silu(gate), then the product
        gate, up = tl.split(tl.permute(tl.reshape(out, (OUT_N, 2, BLOCK_M)), (0, 2, 1)))
        gate = gate.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = silu * up.to(dtype).to(tl.float32)
        cols = tl.program_id(0) * OUT_N + tl.arange(0, OUT_N)
    y_ptrs = y_ptr + rm[None, :].to(tl.int64) * stride_ym + cols[:, None]
    tl.store(y_ptrs, out.to(dtype), mask=(cols < N)[:, None] & (rm < M)[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None,
                swiglu: bool = False, out_dtype: torch.dtype | None = None,
                norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    """x [M, K] (M <= MAX_M) times w [N, K]^T -> [M, N] in x's dtype, fp32 accumulation, one launch.
    `config` None takes default_config. `swiglu`: w is a merged [gate; up] projection [2I, K] and
    the result is silu(gate) * up [M, I], rounded exactly as the product followed by
    kernels_rocm.activation.silu_and_mul (one kernel and one [M, 2I] round trip fewer).
    `out_dtype` torch.float32 keeps the fp32 sums unrounded (a MoE router's logits: the product
    F.linear(x.float(), w.float()) computes, without an fp32 copy of w).
    `norm_weight` [K]: x is RMS-normalized first (eps `norm_eps`), each row over its whole K in
    every program, rounded as kernels_rocm.rms_norm rounds: the product of rms_norm(x) and w
    without the norm's launch (DeepSeek's q_a_layernorm before q_b_proj)."""
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    check_tensor("w", w, 2, (x.dtype,))
    check_dim("w", w, 1, x.shape[1], "x's inner dim")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, 1, SUPPORTED_DTYPES)
        check_dim("norm_weight", norm_weight, 0, x.shape[1], "x's inner dim")
    check_same_device(x=x, w=w, norm_weight=norm_weight)
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M:
        raise ValueError(f"x has {m} rows: skinny_gemm takes at most {MAX_M} (use F.linear)")
    if out_dtype not in (None, x.dtype, torch.float32) or swiglu and out_dtype not in (None, x.dtype):
        raise ValueError(f"out_dtype {out_dtype}: skinny_gemm writes x's dtype {x.dtype} or, without swiglu, "
                         "torch.float32")
    if swiglu and n % 2:
        raise ValueError(f"w has shape {tuple(w.shape)}: swiglu needs an even row count ([gate; up])")
    config = config or default_config(m, n, num_compute_units(x.device), 2 if swiglu else 1)
    _check_config(config, swiglu)
    y = torch.empty(m, n // 2 if swiglu else n, dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, w, y, m, n, k, 1, (x.stride(0), w.stride(0), y.stride(0)), None, config, swiglu, norm_weight, norm_eps)
    return y


def default_bmm_config(m: int, batch: int, n: int, k: int, element_size: int, compute_units: int = 0) -> GemvConfig:
    """skinny_bmm's launch shape: the lanes of a program span one K step that fits in K (MLA's
    heads are short rows: 512 or 128 values), so no lane idles on a masked tail: 16-byte vectors
    and up to 8 warps, or one warp of shorter vectors (down to 4 bytes) for rows under 512 bytes.
    Rows a program as default_config picks them, over all batch x n rows."""
    row_bytes = k * element_size
    warps = max(1, min(8, row_bytes // (32 * 16)))
    vector = 16 if row_bytes >= 32 * 16 else max(4, 1 << (max(row_bytes // 32, 1).bit_length() - 1))
    rows = _rows_a_program(lambda r: batch * triton.cdiv(n, r), compute_units)
    return GemvConfig(block_n=rows, num_warps=warps, vector_bytes=vector)


def skinny_bmm(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """Per batch entry b: y[:, b] = x[:, b] @ w[b]^T, for x [M, B, K] (M <= MAX_M), w [B, N, K]
    -> y [M, B, N] in x's dtype (contiguous), fp32 accumulation, one launch (grid axis 1 is b).
    x and w are read through their strides (unit stride on K only): MLA's per-head absorption
    products take q_nope / the attention output straight from their [tokens, heads, dim] views
    and write the [tokens, heads, dim] layout the next op reads, with no transposing copies."""
    check_tensor("x", x, 3, SUPPORTED_DTYPES)
    check_tensor("w", w, 3, (x.dtype,))
    check_dim("w", w, 0, x.shape[1], "x's batch dim 1")
    check_dim("w", w, 2, x.shape[2], "x's inner dim")
    check_same_device(x=x, w=w)
    m, batch, k = x.shape
    n = w.shape[1]
    if m > MAX_M:
        raise ValueError(f"x has {m} rows: skinny_bmm takes at most {MAX_M} (use torch.bmm)")
    config = config or default_bmm_config(m, batch, n, k, x.element_size(), num_compute_units(x.device))
    _check_config(config, False)
    y = torch.empty(m, batch, n, dtype=x.dtype, device=x.device)
    _launch(x, w, y, m, n, k, batch, (x.stride(0), w.stride(1), y.stride(0)), (x.stride(1), w.stride(0), y.stride(1)),
            config, False)
    return y


def _check_config(config: GemvConfig, swiglu: bool) -> None:
    if config.block_n < 1 or config.block_n & (config.block_n - 1) or swiglu and config.block_n < 2:
        raise ValueError(f"GemvConfig.block_n must be a power of two{' >= 2 with swiglu' if swiglu else ''}, "
                         f"got {config.block_n}")
    if config.num_warps not in NUM_WARPS:
        raise ValueError(f"GemvConfig.num_warps must be one of {NUM_WARPS}, got {config.num_warps}")
    if config.vector_bytes not in (4, 8, 16):
        raise ValueError(f"GemvConfig.vector_bytes must be 4, 8 or 16, got {config.vector_bytes}")


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, m: int, n: int, k: int, batch: int,
            row_strides: tuple[int, int, int], batch_strides: tuple[int, int, int] | None, config: GemvConfig,
            swiglu: bool, norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0) -> None:
    """One launch over cdiv(n, block_n) x batch programs; `n` counts weight rows (2 I with swiglu);
    `batch_strides` (x, w, y) None: one unbatched product; `norm_weight`: the RMSNorm prologue."""
    n_out = n // 2 if swiglu else n
    if not (m and n_out and batch):
        return
    warp_size = 64 if IS_HIP else 32  # the tile layout needs one lane per LANES entry (CDNA: wave64)
    _gemv_kernel[(triton.cdiv(n, config.block_n), batch)](
        # without the norm its arguments go as None (constexpr): the plain GEMV compiles as before
        x, w, y, norm_weight, norm_eps if norm_weight is not None else None, m, n_out, k,
        *row_strides, *(batch_strides or (0, 0, 0)),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n, LANES=warp_size * config.num_warps,
        VEC=max(1, config.vector_bytes // x.element_size()), SWIGLU=swiglu, BATCHED=batch_strides is not None,
        NORM=norm_weight is not None, EARLY_WITHOUT_PDL=INTERPRET,
        num_warps=config.num_warps, **pdl.launch_args(x.device),
    )
