"""Triton building blocks of the MXFP4 GEMMs (`mxfp4_linear`, `mxfp4_moe`).

Format (see model_ops/quant/mxfp4.py, the reference these blocks reproduce): weights are uint8
[N, K/2], two E2M1 codes a byte with the even (first) K element in the low nibble; scales are
uint8 E8M0 [N, K/32], value 2^(byte - 127).

- Weights are dequantized in registers, never in memory. A code's 3 magnitude bits are placed
  at fp32 bits 24..22 (exponent LSBs + top mantissa bit) and its sign at bit 31: that fp32 is
  the E2M1 value times 2^-126 exactly, the two E2M1 subnormals (0 and 0.5) landing on fp32
  subnormals; one multiply by 2^126 normalizes it and one by the block scale applies E8M0.
  Three integer ops and two multiplies per element, no table, no exp2. Compiled for NVIDIA with
  bf16 dots, the same placement is done in PTX on 32-bit registers, two bf16 values an
  instruction (`e2m1_pair_to_bf16_ptx`): the decode is what bounds these GEMMs on an H100
  (docs/benchmarks.md section 6). ROCm and the interpreter use the portable version. Where every
  scale byte of a weight is <= 128 (`foldable_scales`; byte 128 already covers |w| up to 12), the GEMMs make
  one multiply do both: the placed code times 2^126 * scale = 2^(byte - 1) (`e8m0_folded_*`).
- E8M0 scales are built from bits (byte << 23; byte 0 is the subnormal 2^-127, 255 is NaN):
  exp2 flushes 2^-127 to zero on GPUs and is inexact in the Triton interpreter.
- Activations can be quantize-dequantized on the fly with Quark's "even" scale rule, per 32
  consecutive K elements, exactly as `qdq_mxfp4`: the kernels load an activation tile, QDQ it
  in registers and feed it to the dot, so there is no QDQ pass over memory.
- The dot splits K by parity instead of interleaving the two nibbles: the low nibbles of a
  [N, K/2] byte tile are the weights of the even K columns, the high nibbles of the odd ones, so
  acc += A[:, 0::2] @ W_lo^T + A[:, 1::2] @ W_hi^T (the activation tile is split, it is small).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MX_BLOCK = 32  # K elements per E8M0 scale
E2M1_SUBNORMAL_SHIFT = tl.constexpr(2.0**126)  # fp32 placement of an E2M1 code is its value times 2^-126
FOLD_MAX_SCALE_BYTE = 128  # E8M0 bytes up to this fold into the placement's multiply (e8m0_folded_fp32)


@triton.jit
def e8m0_to_fp32(scale):
    """uint8 / int32 E8M0 bytes -> fp32 2^(byte - 127), by bits (byte 0 -> 2^-127, 255 -> NaN)."""
    b = scale.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pair_placed_fp32(packed):
    """uint8 bytes -> (low nibble, high nibble) as placed in fp32: each E2M1 value times 2^-126."""
    b = packed.to(tl.uint32)
    lo = ((b << 28) & 0x80000000) | ((b << 22) & 0x01C00000)
    hi = ((b << 24) & 0x80000000) | ((b << 18) & 0x01C00000)
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pair_to_fp32(packed):
    """uint8 bytes -> (low nibble, high nibble) E2M1 values in fp32, unscaled."""
    lo, hi = e2m1_pair_placed_fp32(packed)
    return lo * E2M1_SUBNORMAL_SHIFT, hi * E2M1_SUBNORMAL_SHIFT


@triton.jit
def e8m0_folded_fp32(scale):
    """E8M0 bytes <= 128 -> 2^126 * 2^(byte - 127) = 2^(byte - 1) in fp32, a normal number: one multiply of a
    placed code (`e2m1_pair_placed_fp32`) applies the placement's 2^126 and the block scale together, exactly.
    Only for weights whose every scale byte is <= 128 (`foldable_scales`): above, 2^(byte - 1) overflows."""
    return ((scale.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_folded_bf16(scale):
    """`e8m0_folded_fp32` in bf16 (the same exponent range): 2^(byte - 1) for E8M0 bytes <= 128."""
    return ((scale.to(tl.int32) + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_to_bf16(scale):
    """uint8 E8M0 bytes -> bf16 2^(byte - 127) by bits (bf16 has fp32's exponent range: byte 0 is
    the bf16 subnormal 0x0040, 255 is NaN)."""
    b = scale.to(tl.int32)
    bits = tl.where(b == 0, 0x0040, b << 7)
    bits = tl.where(b == 255, 0x7FC0, bits)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _e2m1_pair_bf16_asm(normalize: bool) -> str:
    """PTX of the bf16 decodes below: per pair of bytes, prmt spreads them into the two 16-bit
    halves, then one shift-shift-or-and (the or and the and are one LOP3 in SASS) puts each code's
    magnitude bits at 8..6 and its sign at 15, i.e. the E2M1 value times 2^-126 (codes 0 and 0.5
    land on bf16 subnormals). High nibbles: the same after shifting the word right by 4 (the
    neighbouring nibble that lands in each byte's top half is masked away). With `normalize`, one
    bf16x2 fma by 2^126 (0x7E80, with -0.0 added: an exact multiply; sm_80+, keeps subnormals) makes
    the values."""
    lines = [".reg .b32 zero, bias, nzero, u, t, s;", "mov.b32 zero, 0;", "mov.b32 bias, 0x7E807E80;",
             "mov.b32 nzero, 0x80008000;", "shr.b32 u, $4, 4;"]
    for out, (src, sel) in enumerate((("$4", "0x4140"), ("$4", "0x4342"), ("u", "0x4140"), ("u", "0x4342"))):
        lines += [f"prmt.b32 t, {src}, zero, {sel};", "shl.b32 s, t, 6;", "shl.b32 t, t, 12;", "or.b32 t, t, s;"]
        lines += (["and.b32 t, t, 0x81C081C0;", f"fma.rn.bf16x2 ${out}, t, bias, nzero;"] if normalize
                  else [f"and.b32 ${out}, t, 0x81C081C0;"])
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_PAIR_TO_BF16_ASM = tl.constexpr(_e2m1_pair_bf16_asm(normalize=True))
_E2M1_PAIR_PLACED_BF16_ASM = tl.constexpr(_e2m1_pair_bf16_asm(normalize=False))


@triton.jit
def e2m1_pair_to_bf16_ptx(packed):
    """CUDA fast path of `e2m1_pair_to_fp32` for bf16 dots: 4 packed bytes per 32-bit register
    give (low nibbles, high nibbles) as exact bf16 E2M1 values, two per instruction
    (`_e2m1_pair_bf16_asm`)."""
    return tl.inline_asm_elementwise(_E2M1_PAIR_TO_BF16_ASM, "=r,=r,=r,=r,r", [packed],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def e2m1_pair_placed_bf16_ptx(packed):
    """`e2m1_pair_placed_fp32` at bf16 positions, CUDA: the values times 2^-126, for one multiply by
    2^126 times the block scale (`e8m0_folded_bf16`; sm_90's HMUL2.BF16 keeps subnormal inputs)."""
    return tl.inline_asm_elementwise(_E2M1_PAIR_PLACED_BF16_ASM, "=r,=r,=r,=r,r", [packed],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def round_to_e2m1(v):
    """Round fp32 values already divided by their "even" block scale to the E2M1 grid
    {0, 0.5, 1, 1.5, 2, 3, 4, 6}: nearest, ties to the even code.

    Adding C = 2^22 / 2^23 / 2^24 rounds to a multiple of 0.5 / 1 / 2 with the FPU's
    round-to-nearest-even, which is E2M1's spacing on [0, 2) / [2, 4) / [4, 8); the grids nest,
    so a value that rounds up across a boundary lands on a point of both, and an even code is an
    even multiple of its spacing, so RNE's tie rule is the "ties to even code" rule. No value
    reaches 7 (the even rule moves a block whose amax is >= 1.75 * 2^n up to scale 2^(n-1)), so
    (6, 7) rounds to 6 and saturation needs no extra step. The sign is copied by bits: a
    negative value that rounds to zero gives -0, which the reference writes as +0 (equal values).
    """
    mag = tl.abs(v)
    magic = tl.where(mag < 2.0, 4194304.0, tl.where(mag < 4.0, 8388608.0, 16777216.0))
    rounded = (mag + magic) - magic
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _max_with_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _even_scale(blocks):
    """Quark's "even" scale of fp32 blocks [ROWS, B, 32]: (exponent [ROWS, B], finite [ROWS, B]):
    amax rounded at fp32 mantissa bit 21, exponent floor(log2) - 2 clamped to [-127, 127];
    `finite` is False for a block holding NaN/inf (the max keeps NaN: a plain GPU max drops it,
    which would leave a NaN block a finite scale and, in integer codes, lose the NaN)."""
    amax = tl.reduce(tl.abs(blocks), 2, _max_with_nan)
    bits = amax.to(tl.int32, bitcast=True)
    field = ((bits + (1 << 21)) >> 23) & 0xFF
    exponent = tl.where(field == 255, 127, tl.minimum(tl.maximum(field - 129, -127), 127))
    return exponent, (bits & 0x7F800000) != 0x7F800000


@triton.jit
def qdq_mxfp4_blocks(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """MXFP4 quantize-dequantize of an fp32 [ROWS, COLS] tile (COLS a multiple of 32), per 32
    consecutive columns, with Quark's "even" scale (_even_scale); a block holding NaN/inf
    becomes NaN."""
    blocks = tl.reshape(x, [ROWS, COLS // 32, 32])
    exponent, finite = _even_scale(blocks)
    scale = tl.where(finite, e8m0_to_fp32(exponent + 127), float("nan"))
    inv_scale = e8m0_to_fp32(127 - exponent)  # 2^-exponent, exact (multiplying by it = dividing)
    q = round_to_e2m1(blocks * inv_scale[:, :, None]) * scale[:, :, None]
    return tl.reshape(q, [ROWS, COLS])


@triton.jit
def quantize_mxfp4_blocks(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The MXFP4 quantization qdq_mxfp4_blocks dequantizes, kept as integers: (codes, scales),
    codes int8 [ROWS, COLS] twice the E2M1 value (-12..12), scales int32 [ROWS, COLS // 32] E8M0
    bytes, so that qdq = codes / 2 * 2^(scale - 127); a block holding NaN/inf gets codes 0 and
    scale byte 255 (NaN), which makes every product with it NaN as the QDQ'd value does."""
    blocks = tl.reshape(x, [ROWS, COLS // 32, 32])
    exponent, finite = _even_scale(blocks)
    inv_scale = e8m0_to_fp32(127 - exponent)
    q = tl.where(finite[:, :, None], round_to_e2m1(blocks * inv_scale[:, :, None]), 0.0)
    return tl.reshape((q * 2.0).to(tl.int8), [ROWS, COLS]), tl.where(finite, exponent + 127, 255)


@triton.jit
def e2m1_to_int(nibbles):
    """int32 E2M1 codes (0..15, sign in bit 3) -> twice their value, exact (-12..12)."""
    m = nibbles & 7
    mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where(nibbles >= 8, -mag, mag)


@triton.jit
def e2m1_dot_ptx(w, x_lo, x_hi):
    """CUDA: sum over the 8 E2M1 codes of w (int32, element i in nibble i, as packed) of twice
    their value times the int8 activations x_lo (elements 0..3, byte i = element i) and x_hi
    (elements 4..7): an exact int32, in 14 instructions for 8 weights.

    prmt looks each group of 4 codes up in the byte table {0, 1, 2, 3, 4, 6, 8, 12} (twice the
    E2M1 magnitudes), the codes' low 16 bits as the selector: a code whose sign bit is set
    selects in prmt's sign-replicate mode, which gives 0x00 (no table byte has its top bit
    set), so one lookup gives the positive codes' values and zeros, and a second on the codes
    with their sign bits flipped gives the negative codes' magnitudes and zeros. dp4a (signed
    int8 x int8, four products and the sum an instruction) then adds the first and the second
    group's products, which are subtracted.
    """
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 lo_tab, hi_tab, zero, flipped, w_hi, flipped_hi, t, pos, neg;
        mov.b32 lo_tab, 0x03020100;
        mov.b32 hi_tab, 0x0C080604;
        mov.b32 zero, 0;
        xor.b32 flipped, $1, 0x88888888;
        shr.u32 w_hi, $1, 16;
        shr.u32 flipped_hi, flipped, 16;
        prmt.b32 t, lo_tab, hi_tab, $1;
        dp4a.s32.s32 pos, t, $2, zero;
        prmt.b32 t, lo_tab, hi_tab, w_hi;
        dp4a.s32.s32 pos, t, $3, pos;
        prmt.b32 t, lo_tab, hi_tab, flipped;
        dp4a.s32.s32 neg, t, $2, zero;
        prmt.b32 t, lo_tab, hi_tab, flipped_hi;
        dp4a.s32.s32 neg, t, $3, neg;
        sub.s32 $0, pos, neg;
        }""",
        "=r,r,r,r", [w, x_lo, x_hi], dtype=tl.int32, is_pure=True, pack=1,
    )


@triton.jit
def silu_mul(gate, up, OUT_DTYPE: tl.constexpr):
    """The MoE gate/up epilogue: silu(gate) * up in fp32, rounded to the activation dtype."""
    return (gate * tl.sigmoid(gate) * up).to(OUT_DTYPE)


@triton.jit
def load_activation(
    ptrs, mask, QUANTIZE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, DOT_DTYPE: tl.constexpr
):
    """Load an activation tile [ROWS, COLS] (zeros where masked) in DOT_DTYPE, QDQ'd if QUANTIZE
    (and rounded back to its own dtype, as the reference's qdq_mxfp4 returns it)."""
    a = tl.load(ptrs, mask=mask, other=0.0)
    if QUANTIZE:
        a = qdq_mxfp4_blocks(a.to(tl.float32), ROWS, COLS).to(ptrs.dtype.element_ty)
    return a.to(DOT_DTYPE)


@triton.jit
def mxfp4_dot(
    acc, a, w_rows, s_rows, n_valid, k0, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX_DECODE: tl.constexpr, SCALES_FOLD: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += a [BLOCK_M, BLOCK_K] @ W[rows, k0:k0+BLOCK_K]^T for MXFP4 W.

    w_rows / s_rows: [BLOCK_N] pointers to the packed row / scale row of each output column
    (int64 offsets formed by the caller); n_valid masks columns past N; K a multiple of 32.
    PTX_DECODE (compiled CUDA, bf16 dots) decodes with `e2m1_pair_to_bf16_ptx` and scales in
    bf16 (exact: a power of two times an E2M1 value stays in bf16's fp32-sized range).
    SCALES_FOLD (every scale byte of W <= 128, `foldable_scales`): each placed code is multiplied once,
    by 2^126 times its block scale (`e8m0_folded_*`), instead of by 2^126 and then by the scale;
    the same values, a multiply and the E8M0 edge cases (bytes 0 and 255) fewer per weight pair.
    EVEN_K (K a multiple of BLOCK_K): no block of a tile lies past K, so only columns are masked; the
    scale bytes of a row then load as one vector instead of byte by byte (H100, grouped W4A4 at
    T = 256-512: 1-2% faster, bit-equal; docs/benchmarks.md section 6).
    """
    groups = tl.arange(0, BLOCK_K // 32)
    if EVEN_K:
        s_mask = n_valid[:, None]
        w_mask = n_valid[:, None, None]
    else:
        k_valid = (k0 + groups * 32) < K  # whole 32-blocks are in or out
        s_mask = n_valid[:, None] & k_valid[None, :]
        w_mask = n_valid[:, None, None] & k_valid[None, :, None]
    scale_bytes = tl.load(s_rows[:, None] + k0 // 32 + groups[None, :], mask=s_mask, other=127)
    byte_offs = k0 // 2 + groups[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16]
    packed = tl.load(w_rows[:, None, None] + byte_offs[None, :, :], mask=w_mask, other=0)
    if PTX_DECODE:
        if SCALES_FOLD:
            scale = e8m0_folded_bf16(scale_bytes)[:, :, None]
            lo, hi = e2m1_pair_placed_bf16_ptx(packed)
        else:
            scale = e8m0_to_bf16(scale_bytes)[:, :, None]
            lo, hi = e2m1_pair_to_bf16_ptx(packed)
    else:
        lo, hi = e2m1_pair_placed_fp32(packed)
        if SCALES_FOLD:
            scale = e8m0_folded_fp32(scale_bytes)[:, :, None]
        else:
            scale = e8m0_to_fp32(scale_bytes)[:, :, None]
            lo, hi = lo * E2M1_SUBNORMAL_SHIFT, hi * E2M1_SUBNORMAL_SHIFT
    w_even = tl.reshape((lo * scale).to(DOT_DTYPE), [BLOCK_N, BLOCK_K // 2])
    w_odd = tl.reshape((hi * scale).to(DOT_DTYPE), [BLOCK_N, BLOCK_K // 2])
    a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
    acc = tl.dot(a_even, tl.trans(w_even), acc, input_precision=DOT_PRECISION)
    return tl.dot(a_odd, tl.trans(w_odd), acc, input_precision=DOT_PRECISION)


def foldable_scales(*scales: torch.Tensor) -> bool:
    """Whether every E8M0 byte of these weight scales is <= FOLD_MAX_SCALE_BYTE (scales <= 2: blocks of
    magnitude up to 12, far above an LLM's weights; the tensors decide, nothing is assumed), so that the
    GEMMs may fold each scale into the decode's multiply (`mxfp4_dot`'s SCALES_FOLD). Reads the tensors
    back to the host: once per weight, after loading."""
    return all(int(s.max()) <= FOLD_MAX_SCALE_BYTE for s in scales if s.numel())


def check_mxfp4_weight(name: str, weight, scale, scale_name: str, k: int | None = None) -> None:
    """Raise ValueError unless weight [..., K/2] and scale [..., K/32] are uint8 and agree."""
    for n, t in ((name, weight), (scale_name, scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise ValueError(f"{n} must be a uint8 tensor (MXFP4 packed bytes / E8M0 scales), "
                             f"got {getattr(t, 'dtype', type(t).__name__)}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{n} must be contiguous in its last dim, got strides {t.stride()}")
    if weight.shape[:-1] != scale.shape[:-1] or weight.shape[-1] * 2 != scale.shape[-1] * MX_BLOCK:
        raise ValueError(
            f"{scale_name} shape {tuple(scale.shape)} does not match {name} shape {tuple(weight.shape)}: "
            f"expected [..., {weight.shape[-1] * 2 // MX_BLOCK}] (one E8M0 byte per 32 K elements)"
        )
    if k is not None and weight.shape[-1] * 2 != k:
        raise ValueError(f"{name} shape {tuple(weight.shape)} packs {weight.shape[-1] * 2} K elements, "
                         f"the input has {k}")
