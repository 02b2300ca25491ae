"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

One program per row; the row stays in registers, so x (and the residual) are read once and the
output (and the updated residual) written once, instead of the ~6 passes of the eager version.
Rounding follows the HF Llama/DeepSeek modules exactly: the residual sum is rounded to the
activation dtype before it is normalized, and the normalized row is rounded to the activation
dtype before the weight multiply.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import SUPPORTED_DTYPES, check_dim, check_out, check_same_device, check_tensor

MAX_HIDDEN = 65_536  # one row per program held in registers


@triton.jit
def rms_scale(h, rstd, weight, DTYPE: tl.constexpr):
    """The HF RMSNorm's rounding, one place for every kernel that normalizes (this one, the fused
    all-reduce + norm, the MLA cache write, the GEMV prologue): h (fp32) times rstd rounded to the
    activation dtype DTYPE, times the weight, rounded again; returned in DTYPE."""
    return ((h * rstd).to(DTYPE).to(tl.float32) * weight.to(tl.float32)).to(DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x: tl.int64, stride_residual: tl.int64, stride_out: tl.int64,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * stride_residual + offs
        h = (h.to(tl.float32) + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_row, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, rms_scale(h, rstd, weight, x_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out):
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)), **pdl.launch_args(x.device),
    )


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    check_tensor("weight", weight, 1, SUPPORTED_DTYPES)
    check_dim("weight", weight, 0, x.shape[1], "x's hidden size")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"x has shape {tuple(x.shape)}: hidden size above {MAX_HIDDEN} is not supported")
    check_out(out, x, "x", (x.dtype,))
    check_same_device(x=x, weight=weight, out=out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rms_normalize(x) for x [T, H], weight [H]; returns out [T, H] in x's dtype."""
    _check(x, weight, out)
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, eps, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in place, rounded to x's dtype); returns
    (weight * rms_normalize(residual), residual)."""
    _check(x, weight, out)
    check_tensor("residual", residual, 2, (x.dtype,))
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
    check_same_device(x=x, residual=residual)
    out = torch.empty_like(x) if out is None else out
    _launch(x, residual, weight, eps, out)
    return out, residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The HF Llama/DeepSeek RMSNorm in eager PyTorch: the oracle and the benchmark baseline."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
