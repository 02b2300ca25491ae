"""The W4A4 decode path's integer dot (kernels_rocm._mxfp4.e2m1_dot_ptx / mxfp4_moe_decode):

- the PTX algorithm (prmt table lookups in sign-replicate mode, dp4a) emulated bit for bit in
  Python against a plain integer dot, over every code and activation byte: the asm's logic,
  which the interpreter cannot run (tests/gpu/test_kernels_mxfp4_gpu.py runs the asm itself);
- `quantize_rows`: codes and scales equal to model_ops' quantize_mxfp4, in paired word order;
- one block through `_int_block_partial` (portable) and through the dequantizing
  `_block_partial` on the same QDQ'd activations: the same fp32 bits (exact products and sums),
  E8M0 bytes 0 and 254 and NaN activation blocks included.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels_rocm import mxfp4_moe_decode as mod
from kernels_rocm._mxfp4 import E2M1_SUBNORMAL_SHIFT  # noqa: F401  (the module must import)
from model_ops.quant.mxfp4 import E2M1_VALUES, qdq_mxfp4, quantize_mxfp4, unpack_e2m1

TWICE = [int(2 * v) for v in E2M1_VALUES]  # code -> twice its value, codes 8..15 negative


def _prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 d, a, b, c (default mode): result byte i from selector nibble i of c[15:0]."""
    table = (a | (b << 32)).to_bytes(8, "little")
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = table[sel & 7]
        if sel & 8:  # sign-replicate: the selected byte's top bit, everywhere
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _dp4a(a: int, b: int, c: int) -> int:
    """PTX dp4a.s32.s32: c + the dot of a's and b's bytes as signed int8."""
    sa, sb = (int.from_bytes(v.to_bytes(4, "little"), "little", signed=False) for v in (a, b))
    def s8(v, i):
        x = (v >> (8 * i)) & 0xFF
        return x - 256 if x & 0x80 else x
    return c + sum(s8(sa, i) * s8(sb, i) for i in range(4))


def _ptx_dot(w: int, x_lo: int, x_hi: int) -> int:
    """e2m1_dot_ptx's asm, instruction by instruction."""
    lo_tab, hi_tab = 0x03020100, 0x0C080604
    flipped = w ^ 0x88888888
    pos = _dp4a(_prmt(lo_tab, hi_tab, w), x_lo, 0)
    pos = _dp4a(_prmt(lo_tab, hi_tab, w >> 16), x_hi, pos)
    neg = _dp4a(_prmt(lo_tab, hi_tab, flipped), x_lo, 0)
    neg = _dp4a(_prmt(lo_tab, hi_tab, flipped >> 16), x_hi, neg)
    return pos - neg


def test_the_ptx_algorithm_is_an_exact_integer_dot():
    g = torch.Generator().manual_seed(3)
    codes = [list(range(16))[i:i + 8] for i in (0, 8)] + [torch.randint(0, 16, (8,), generator=g).tolist()
                                                          for _ in range(300)]
    for nibbles in codes:
        w = sum(n << (4 * i) for i, n in enumerate(nibbles))
        acts = torch.randint(-12, 13, (8,), generator=g).tolist()
        for xs in (acts, [12] * 8, [-12] * 8, [0] * 8):
            x_lo = int.from_bytes(bytes(v & 0xFF for v in xs[:4]), "little")
            x_hi = int.from_bytes(bytes(v & 0xFF for v in xs[4:]), "little")
            assert _ptx_dot(w, x_lo, x_hi) == sum(TWICE[n] * v for n, v in zip(nibbles, xs)), (nibbles, xs)


def _unpair(codes: torch.Tensor) -> torch.Tensor:
    """quantize_rows' paired word order (0, 2, 4, 6, 1, 3, 5, 7 in each block) back to element order."""
    words = codes.view(codes.shape[0], -1, 2, 4, 4)  # [rows, blocks, half, i, byte]: word 2i + half
    return words.transpose(2, 3).reshape(codes.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_the_torch_quantizer(dtype):
    """Rows of several blocks (a masked tail block: width 3 x 32 under a 128-wide launch block),
    magnitudes from 1e-30 to 1e30, a zero block, a block of exact ties, a block with one NaN."""
    g = torch.Generator().manual_seed(41)
    x = torch.randn(5, 96, generator=g) * torch.logspace(-30, 30, 5)[:, None]
    x[1, :32] = 0.0
    x[2, 32:64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # ties
    x[3, 70] = float("nan")
    x = x.to(dtype)
    codes, scales = mod.quantize_rows(x)
    packed, ref_scales = quantize_mxfp4(x)
    assert torch.equal(scales, ref_scales)
    ref_codes = torch.tensor(TWICE, dtype=torch.int8)[unpack_e2m1(packed).long()]
    finite = torch.isfinite(x).view(5, 3, 32).all(-1).repeat_interleave(32, dim=1)
    assert torch.equal(_unpair(codes)[finite], ref_codes[finite]) and (_unpair(codes)[~finite] == 0).all()


@triton.jit
def _both_partials(w_ptr, w_words_ptr, s_ptr, a_ptr, codes_ptr, xs_ptr, out_ptr, R: tl.constexpr,
                   PTX: tl.constexpr):
    """One 32-element block of R weight rows through the dequantizing and the integer partial
    (PTX: both with their CUDA asm; tests/gpu/test_kernels_mxfp4_gpu.py)."""
    rows = tl.arange(0, R)[None, None, :]
    lane = tl.zeros([1, 1, 1], tl.int32)
    valid = lane == 0
    byte = tl.arange(0, 16)[None, None, None, :]
    act = (tl.arange(0, 4)[:, None] * 8 + tl.arange(0, 8)[None, :])[None, None, :, :]
    a_even, a_odd = mod._activation_block(a_ptr + act, valid, 1, 1)
    f = mod._block_partial(w_ptr + rows[:, :, :, None] * 16 + byte, s_ptr + rows, a_even, a_odd, valid, PTX)
    words = tl.arange(0, 4)[None, None, None, :]
    x_lo, x_hi, a_scale = mod._int_activation_block(codes_ptr + words, xs_ptr + lane, valid)
    i = mod._int_block_partial(w_words_ptr + rows[:, :, :, None] * 4 + words, s_ptr + rows, x_lo, x_hi, a_scale,
                               valid, PTX)
    tl.store(out_ptr + rows, f)
    tl.store(out_ptr + R + rows, i)


def both_partials(case: str, device: str = "cpu", ptx: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized, integer) block partials of 256 random rows (every code, scale bytes around
    127, or 0 and 254 with tiny activations, or a NaN activation)."""
    g = torch.Generator().manual_seed(7)
    rows = 256
    w = torch.randint(0, 256, (rows, 16), generator=g).to(torch.uint8)
    s = torch.randint(100, 150, (rows,), generator=g).to(torch.uint8)
    x = torch.randn(1, 32, generator=g) * 3
    if case == "extreme scales":
        s[:8], s[8:16] = 0, 254
        w[8:16] &= 0xBB  # magnitudes <= 1.5 under 2^127: finite
        x = x * 2.0**-100
    if case == "nan block":
        x[0, 5] = float("nan")
    w, s, x = w.to(device), s.to(device), x.to(device)
    codes, scales = mod.quantize_rows(x)
    out = torch.empty(2 * rows, device=device)
    _both_partials[(1,)](w, w.view(torch.int32), s, qdq_mxfp4(x), codes.view(torch.int32), scales, out, R=rows,
                         PTX=ptx)
    return out[:rows].cpu(), out[rows:].cpu()


@pytest.mark.parametrize("case", ["random", "extreme scales", "nan block"])
def test_integer_block_equals_the_dequantized_block_bit_for_bit(case):
    f, i = both_partials(case)
    if case == "nan block":
        assert f.isnan().all() and i.isnan().all()
    else:
        assert torch.isfinite(f).all() and torch.equal(f.view(torch.int32), i.view(torch.int32))
