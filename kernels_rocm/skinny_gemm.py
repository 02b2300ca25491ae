"""Split-K GEMM for skinny activations: y [M, N] = x [M, K] @ w [N, K]^T for M = 1..64.

At decode sizes a projection is a weight read: M is the batch, so a GEMM library's tile over M
mostly computes padding and, for narrow N (o_proj: N = 4096), launches too few tiles to keep
every SM pulling weights. Here the grid also splits K, so there are at least ~2 programs per SM
whatever N is; each program reduces its K range with tl.dot (fp32 accumulation) and adds its
partial tile into an fp32 output with atomics; the result is cast to x's dtype at the end.

Not wired into model_ops yet: ci/bench_roofline.py measures it against cuBLAS (F.linear) on the
Llama-3.1-8B projections, and a model path should take it only where that measurement says so.
The summation order differs from a GEMM library's (split partials, atomics), so results agree
to accumulation rounding, not bit for bit, and are not run-to-run deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm._util import (
    SUPPORTED_DTYPES,
    UPCAST_DOT,
    check_dim,
    check_same_device,
    check_tensor,
    dot_precision,
    num_compute_units,
)

MAX_M = 64  # beyond this a GEMM library's tiles are full enough


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, acc_ptr,
    M, N, K, k_per_split,
    stride_xm: tl.int64, stride_wn: tl.int64, stride_am: tl.int64,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = rm < M, rn < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_valid = rk < K  # k_per_split is a multiple of BLOCK_K: a block never crosses into the next split
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.atomic_add(acc_ptr + rm[:, None].to(tl.int64) * stride_am + rn[None, :], acc,
                  mask=m_valid[:, None] & n_valid[None, :])


def split_k_for(m: int, n: int, k: int, device: torch.device, block_m: int, block_n: int, block_k: int) -> int:
    """Splits of K so that the grid has about two programs per compute unit (each split at least one K block)."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    return max(1, min(triton.cdiv(k, block_k), triton.cdiv(2 * num_compute_units(device), tiles)))


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 128,
                split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M) times w [N, K]^T -> [M, N] in x's dtype (fp32 accumulation).
    `split_k` None picks one from the device's compute units (split_k_for)."""
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    check_tensor("w", w, 2, (x.dtype,))
    check_dim("w", w, 1, x.shape[1], "x's inner dim")
    check_same_device(x=x, w=w)
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M:
        raise ValueError(f"x has {m} rows: skinny_gemm is for at most {MAX_M} (use F.linear)")
    block_m = 16  # tl.dot's smallest tile; rows past M are masked loads, no extra bytes
    if split_k is None:
        split_k = split_k_for(m, n, k, x.device, block_m, block_n, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        grid = (triton.cdiv(n, block_n), triton.cdiv(k, k_per_split), triton.cdiv(m, block_m))
        _skinny_gemm_kernel[grid](
            x, w, acc, m, n, k, k_per_split, x.stride(0), w.stride(0), acc.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            UPCAST=UPCAST_DOT, PRECISION=dot_precision(x.dtype),
        )
    return acc.to(x.dtype)
