"""SiLU-and-mul (SwiGLU) on a merged [gate | up] projection: one kernel instead of four.

Eagerly it is a chunk, a SiLU, a multiply and their temporaries; here each program reads a tile
of gate and up once and writes silu(gate) * up once. Rounding follows the eager ops: silu(gate)
is rounded to the activation dtype before the multiply, whose product is rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import SUPPORTED_DTYPES, check_same_device, check_tensor

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x: tl.int64, stride_out: tl.int64, width,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I] in x's dtype."""
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    num_tokens, merged = x.shape
    if merged % 2:
        raise ValueError(f"x has shape {tuple(x.shape)}: the last dim must be even ([gate | up])")
    width = merged // 2
    if out is None:
        out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, 2, (x.dtype,))
        if tuple(out.shape) != (num_tokens, width):
            raise ValueError(f"out shape {tuple(out.shape)} must be {(num_tokens, width)} (x's rows, half its width)")
    check_same_device(x=x, out=out)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, BLOCK))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=BLOCK, num_warps=4, **pdl.launch_args(x.device),
        )
    return out
