"""The W4A4 tensor-core path of the MXFP4 fused MoE (kernels_rocm.mxfp4_moe_int_mma) under the
Triton interpreter (its portable code lookup; tl.dot of int8 tiles into int32 is numpy's exact
integer matmul there), against the contract's reference (weights dequantized, activations and h
QDQ'd by model_ops.quant.mxfp4): one block's scaled dot bit for bit, odd token counts, experts
with no pairs, several blocks of one expert, every loop-step width, ids out of range, E8M0 bytes 0
and 254, NaN activations, a fused shared-expert slot, bf16, and bad configs refused. The PTX code
lookup (`e2m1_split_codes_ptx`), which the interpreter cannot run, is emulated instruction by
instruction against the E2M1 table for every code in every nibble; tests/gpu runs the asm itself.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from _kernel_cases import nan_like
from test_kernels_mxfp4 import (
    EXPERTS, HIDDEN, INTER, _close, _moe_case, _moe_reference, _random_mxfp4, _with_extreme_scales,
)
from test_kernels_mxfp4_int_dot import TWICE, _prmt, _unpair
from kernels_rocm import mxfp4_moe_int_mma as mod
from kernels_rocm.mxfp4_moe import fused_moe_mxfp4
from kernels_rocm.mxfp4_moe_decode import quantize_rows
from kernels_rocm.mxfp4_moe_int_mma import IntMmaConfig
from model_ops.quant.mxfp4 import dequantize_mxfp4, qdq_mxfp4


def _split_asm(w: int) -> list[int]:
    """e2m1_split_codes_ptx's asm on one word, instruction by instruction: (pos_lo, pos_hi, neg_lo, neg_hi)."""
    lo_tab, hi_tab = 0x03020100, 0x0C080604
    flipped = w ^ 0x88888888
    return [_prmt(lo_tab, hi_tab, w), _prmt(lo_tab, hi_tab, w >> 16),
            _prmt(lo_tab, hi_tab, flipped), _prmt(lo_tab, hi_tab, flipped >> 16)]


def test_the_ptx_split_lookup_gives_the_signed_codes_apart():
    """Every code (0..15) in every nibble position: byte i of pos_lo / neg_lo is twice the
    magnitude of element i when positive / negative (else 0), pos_hi / neg_hi the same for
    element 4 + i; pos - neg is twice the E2M1 value."""
    for code in range(16):
        for position in range(8):
            w = code << (4 * position) | 0x11111111 & ~(0xF << (4 * position))  # other nibbles code 1
            parts = [v.to_bytes(4, "little") for v in _split_asm(w)]
            for i in range(8):
                half, byte = divmod(i, 4)
                pos, neg = parts[half][byte], parts[2 + half][byte]
                assert pos - neg == TWICE[(w >> (4 * i)) & 15] and min(pos, neg) == 0, (code, position, i)


@triton.jit
def _split_probe_kernel(packed_ptr, out_ptr):
    packed = tl.load(packed_ptr + tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :])
    parts = mod.e2m1_split_codes(packed, 4, 16)
    offs = tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :]
    for p in tl.static_range(4):
        tl.store(out_ptr + p * 64 + offs, parts[p])


def test_the_portable_split_lookup_matches_the_asm():
    """e2m1_split_codes (the interpreter's and ROCm's form) equals the emulated asm on random bytes."""
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (4, 16), generator=g).to(torch.uint8)
    out = torch.empty(4, 4, 16, dtype=torch.int8)
    _split_probe_kernel[(1,)](packed, out)
    words = packed.view(torch.int32).view(-1).tolist()
    want = torch.tensor([[list(_split_asm(w & 0xFFFFFFFF)[p].to_bytes(4, "little")) for w in words] for p in range(4)],
                        dtype=torch.int16).view(4, 4, 16)
    assert torch.equal(out.to(torch.int16), want)


def test_quantize_rows_mma_layout():
    """Each block's codes (element order) then their negations; fp32 scales 2^(byte - 127), NaN for 255."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=g)
    x[1, 40] = float("nan")
    codes, scales = quantize_rows(x)
    codes = _unpair(codes).view(3, 3, 32)
    mma_codes, mma_scales = quantize_rows(x, mma_layout=True)
    blocks = mma_codes.view(3, 3, 2, 32)
    assert torch.equal(blocks[:, :, 0], codes) and torch.equal(blocks[:, :, 1], -codes)
    bits = torch.where(scales == 0, 0x400000, scales.to(torch.int32) << 23)
    want = torch.where(scales == 255, float("nan"), bits.view(torch.float32))
    torch.testing.assert_close(mma_scales, want, equal_nan=True, rtol=0, atol=0)


@triton.jit
def _block_probe_kernel(w_ptr, s_ptr, a_ptr, as_ptr, out_ptr):
    """One 32-element block: weights [64 rows, 16 bytes] against 16 activation rows, unscaled back."""
    rows = tl.arange(0, 64)
    w = mod._weight_codes(w_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :], 64, False)
    a = tl.trans(tl.load(a_ptr + tl.arange(0, 16)[:, None] * 64 + tl.arange(0, 64)[None, :]))
    scale = tl.load(as_ptr + tl.arange(0, 16))
    zeros = tl.zeros([64, 16], tl.float32)
    acc = mod._block_dot(w, a, scale, scale * -mod.MAGIC, mod._weight_scale(s_ptr + rows), zeros)
    tl.store(out_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :], acc * mod.UNSCALE)


@pytest.mark.parametrize("scales", ["moderate", "extreme"])
def test_one_block_is_the_dequantized_block_sum_bit_for_bit(scales):
    """Every (row, pair) block value equals the fp32 sum of the dequantized weights times the QDQ'd
    activations (exact: E2M1 products times powers of two), bit for bit, E8M0 bytes 0 and 254 too."""
    g = torch.Generator().manual_seed(4)
    packed, scale = _random_mxfp4(64, 32, g=g, low=100, high=150)
    x = torch.randn(16, 32, generator=g)
    if scales == "extreme":
        scale[:32], scale[32:] = 0, 254
        packed[32:] &= 0xBB  # magnitudes <= 1.5 under 2^127
        x[:8] *= 2.0**120
        x[8:] *= 2.0**-126
    codes, a_scales = quantize_rows(x, mma_layout=True)
    out = torch.empty(64, 16)
    _block_probe_kernel[(1,)](packed, scale, codes, a_scales, out)
    ref = dequantize_mxfp4(packed, scale) @ qdq_mxfp4(x).T
    if scales == "extreme":  # rows of byte 0 with the 2^120 pairs, byte 254 with the 2^-126 ones: O(1) values
        out, ref = torch.cat([out[:32, :8], out[32:, 8:]]), torch.cat([ref[:32, :8], ref[32:, 8:]])
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("config", [IntMmaConfig(), IntMmaConfig(block_m=8, warps=1, gate_up_rows=32),
                                    IntMmaConfig(block_m=32, k_blocks=2),
                                    IntMmaConfig(gate_up_rows=128, down_rows=32, k_blocks=1)],
                         ids=["default", "m8_one_warp", "m32_k2", "rows128_k1"])
@pytest.mark.parametrize("num_tokens", [5, 13], ids=lambda t: f"T{t}")
def test_matches_the_reference(num_tokens, config):
    """Experts 1 and 5 get no pairs, expert 2 every token, the others one or a few pairs; I = 3
    blocks (rows past I masked), H = 2 blocks; exact in fp32 up to the order of adding blocks."""
    g = torch.Generator().manual_seed(num_tokens)
    x, w13, s13, w2, s2, weights, ids = _moe_case(num_tokens, 3, g)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids.to(torch.int32), True, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))


def test_several_k_steps_an_expert_over_two_blocks_and_ids_out_of_range():
    """H of 36 blocks (nine loop steps of 4), I of 3 (steps of 1); 20 tokens on one expert (two
    16-pair blocks); an id out of range adds nothing (the alignment drops it; the slot sum skips
    its unwritten row)."""
    g = torch.Generator().manual_seed(30)
    x, w13, s13, w2, s2, weights, ids = _moe_case(20, 2, g, hot=3, hidden=36 * 32, inter=96)
    ids[1, 1] = EXPERTS
    ids[2, 0] = -1
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, out=nan_like(x), config=IntMmaConfig())
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))


def test_e8m0_bytes_0_and_254():
    g = torch.Generator().manual_seed(12)
    x, w13, s13, w2, s2, weights, ids = _moe_case(4, 2, g, hot=3)
    w13, s13, x = _with_extreme_scales(w13, s13, x, g)
    ref = _moe_reference(x, w13, s13, w2, s2, weights, ids, True)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    _close(fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=IntMmaConfig()), ref)


def test_a_nan_activation_reaches_its_token_only():
    """A NaN in x makes that token's activation block NaN (scale NaN): its output is NaN, the
    other tokens', sharing its experts and its MMA tiles, are not."""
    g = torch.Generator().manual_seed(40)
    x, w13, s13, w2, s2, weights, ids = _moe_case(3, 2, g, hot=4)
    x[1, 7] = float("nan")
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=IntMmaConfig())
    assert out[1].isnan().all()
    _close(out[[0, 2]], _moe_reference(x[[0, 2]], w13, s13, w2, s2, weights[[0, 2]], ids[[0, 2]], True))


def test_with_a_fused_shared_expert_slot():
    """Kimi's routing with the shared expert as expert E at weight 1.0 in a last slot: every
    token's pair of it in one block (17 tokens: two blocks)."""
    from model_ops.moe import append_shared_expert

    g = torch.Generator().manual_seed(15)
    num_tokens, routed = 17, EXPERTS
    w13, s13 = _random_mxfp4(routed + 1, 2 * INTER, HIDDEN, g=g, low=120, high=126)
    w2, s2 = _random_mxfp4(routed + 1, HIDDEN, INTER, g=g, low=120, high=126)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(routed, generator=g)[:3] for _ in range(num_tokens)])
    weights, ids = append_shared_expert(torch.rand(num_tokens, 3, generator=g), ids, routed)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, out=nan_like(x), config=IntMmaConfig())
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))


def test_bfloat16():
    g = torch.Generator().manual_seed(32)
    x, w13, s13, w2, s2, weights, ids = _moe_case(6, 2, g)
    ref = _moe_reference(x.bfloat16(), w13, s13, w2, s2, weights, ids, True).float()
    out = fused_moe_mxfp4(x.bfloat16(), w13, s13, w2, s2, weights, ids, True, config=IntMmaConfig())
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


def test_default_config_follows_the_pairs_an_expert_gets():
    assert mod.default_config(128 * 8, 384) == IntMmaConfig(block_m=8)  # 2.7 pairs an expert
    assert mod.default_config(512 * 8, 384) == IntMmaConfig(block_m=16)  # 10.7


def test_refuses_bad_configs_and_bf16_activations():
    g = torch.Generator().manual_seed(33)
    x, w13, s13, w2, s2, weights, ids = _moe_case(2, 2, g)
    for bad, field in ((IntMmaConfig(block_m=4), "block_m"), (IntMmaConfig(down_rows=96), "down_rows"),
                       (IntMmaConfig(warps=4), "warps"), (IntMmaConfig(k_blocks=3), "k_blocks"),
                       (IntMmaConfig(stages=0), "stages")):
        with pytest.raises(ValueError, match=field):
            fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=bad)
    with pytest.raises(ValueError, match="quantize_activations"):
        fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, False, config=IntMmaConfig())
