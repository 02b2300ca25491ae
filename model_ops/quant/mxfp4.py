"""OCP MXFP4 as AMD Quark writes it: the pure-PyTorch reference (the CPU path and every kernel's oracle).

A block of 32 consecutive elements along the last (input, K) axis shares one E8M0 scale byte
(value 2^(byte - 127); byte 0 is 2^-127, an fp32 subnormal; byte 255 is NaN). Each element is an
E2M1 code (1 sign, 2 exponent, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two codes a byte
with the FIRST element in the LOW nibble (quark/torch/utils/pack.py Pack_fp4). Shapes: packed
[..., K/2] uint8, scales [..., K/32] uint8.

Quantization follows Quark's "even" scale rule (quark.torch.quantization.utils.even_round):
amax of the block, rounded at fp32 mantissa bit 21 (blocks whose amax is >= 1.75 * 2^n move up
to 2^(n+1)), exponent = floor(log2) - 2 (E2M1's emax), clamped to [-127, 127]; elements are
x / 2^exponent rounded to nearest E2M1 value, ties to the even code, saturated at +-6. This is
how a checkpoint quantized with `input_tensors: {dtype: fp4, is_dynamic: true}` sees its GEMM
inputs at run time; tests check it bit for bit against amd-quark.

Scales are decoded by building fp32 bits, never exp2: exp2 flushes 2^-127 to zero on GPUs
(FTZ) and is inexact in the Triton interpreter.
"""
from __future__ import annotations

import torch

BLOCK = 32  # elements per shared scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 255
_EMAX_E2M1 = 2
# |x| thresholds between consecutive E2M1 magnitudes; at a tie the even code wins, so the
# comparison is strict where the lower code is even and inclusive where the upper one is.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> fp32 2^(byte - 127), exactly: byte 0 -> 2^-127, byte 255 -> NaN."""
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> E2M1 codes uint8 [..., K] (even element from the low nibble)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., K] -> uint8 [..., K/2], first of each pair in the low nibble."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., K/2] and scales uint8 [..., K/32] -> values [..., K] in `dtype`
    (computed in fp32: every E2M1 value times a power of two is exact there)."""
    _check_packed(packed, scale)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[unpack_e2m1(packed).long()]
    scales = e8m0_to_float32(scale).repeat_interleave(BLOCK, dim=-1)
    return (values * scales).to(dtype)


def mxfp4_scale_exponents(x: torch.Tensor) -> torch.Tensor:
    """Quark's "even" shared exponent of each 32-element block of x [..., K] -> int32 [..., K/32]
    in [-127, 127], or 128 (-> byte 255, NaN) for a block holding a NaN or an infinity."""
    amax = x.float().unflatten(-1, (-1, BLOCK)).abs().amax(dim=-1)
    field = ((amax.view(torch.int32) + (1 << 21)) >> 23) & 0xFF  # round at mantissa bit 21, keep the exponent
    # zero / subnormal amax -> -127 by the clamp; a finite amax that rounds up past the largest
    # exponent (field 255, "infinity") -> 127, as log2(inf) clamped does in Quark
    exponent = torch.where(field == 255, 127, (field - 127 - _EMAX_E2M1).clamp(-127, 127))
    return torch.where(torch.isfinite(amax), exponent, torch.full_like(exponent, 128))


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> (packed uint8 [..., K/2], scales uint8 [..., K/32])."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes blocks of {BLOCK} along the last dim; got {x.shape[-1]} elements")
    exponent = mxfp4_scale_exponents(x)
    scale = (exponent + 127).to(torch.uint8)
    scaled = x.float().unflatten(-1, (-1, BLOCK)) / e8m0_to_float32(scale)[..., None]
    magnitude = scaled.abs()
    code = torch.zeros_like(magnitude, dtype=torch.int32)
    for threshold, inclusive in _THRESHOLDS:
        code += (magnitude >= threshold if inclusive else magnitude > threshold).to(torch.int32)
    # a value that rounds to zero is +0 (code 0), as Quark's quantizer and packer write it
    code |= (torch.signbit(scaled) & (code != 0)).to(torch.int32) << 3
    return pack_e2m1(code.flatten(-2)), scale


def qdq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize x [..., K] through MXFP4 (the emulation of MXFP4 activations), in x's dtype."""
    packed, scale = quantize_mxfp4(x)
    return dequantize_mxfp4(packed, scale, x.dtype)


def _check_packed(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weights and scales are uint8; got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * BLOCK:
        raise ValueError(f"MXFP4 packed {tuple(packed.shape)} and scale {tuple(scale.shape)} disagree: "
                         f"expected scale [..., {packed.shape[-1] * 2 // BLOCK}] for packed [..., {packed.shape[-1]}]")
