"""The W4A4 expert-grouped GEMV path of the MXFP4 fused MoE (kernels_rocm.mxfp4_moe_expert_gemv)
under the Triton interpreter, fp32 (its portable integer dots), against the contract's reference
(weights dequantized, activations and h QDQ'd by model_ops.quant.mxfp4): odd token counts,
experts with no pairs, several pairs an expert and blocks of one, ids out of range, E8M0 bytes 0
and 254, NaN activations, a fused shared-expert slot, bf16, and bad configs refused. The PTX
code lookup (`e2m1_codes_ptx`), which the interpreter cannot run, is emulated instruction by
instruction against the E2M1 table for every code in every nibble; tests/gpu runs the asm itself.
"""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import nan_like
from test_kernels_mxfp4 import (
    EXPERTS, HIDDEN, INTER, _close, _moe_case, _moe_reference, _random_mxfp4, _with_extreme_scales,
)
from test_kernels_mxfp4_int_dot import TWICE, _dp4a, _prmt
from kernels_rocm.mxfp4_moe import fused_moe_mxfp4
from kernels_rocm.mxfp4_moe_expert_gemv import ExpertGemvConfig, default_config



def _codes_asm(w: int) -> tuple[int, int]:
    """e2m1_codes_ptx's asm, instruction by instruction (32-bit wrap-around arithmetic)."""
    lo_tab, hi_tab, mask = 0x03020100, 0x0C080604, 0xFFFFFFFF
    flipped = w ^ 0x88888888
    out = []
    for sel, fsel in ((w, flipped), (w >> 16, flipped >> 16)):
        t = _prmt(lo_tab, hi_tab, sel)
        n = _prmt(lo_tab, hi_tab, fsel)
        n = ((0x80808080 - n) & mask) ^ 0x80808080
        out.append(t | n)
    return out[0], out[1]


def test_the_ptx_code_lookup_gives_signed_twice_e2m1_values():
    """Every code (0..15) in every nibble position: the byte is twice the E2M1 value as int8
    (negative codes two's complement, -0 as 0), and dp4a of the two words against activations
    equals the plain integer dot."""
    g = torch.Generator().manual_seed(4)
    for code in range(16):
        for position in range(8):
            w = code << (4 * position) | 0x11111111 & ~(0xF << (4 * position))  # other nibbles code 1
            lo, hi = _codes_asm(w)
            data = lo | hi << 32
            got = [int.from_bytes(data.to_bytes(8, "little")[i:i + 1], "little", signed=True) for i in range(8)]
            want = [TWICE[(w >> (4 * i)) & 15] for i in range(8)]
            assert got == want, (code, position)
    for _ in range(200):
        w = int(torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64))
        x = torch.randint(-12, 13, (8,), generator=g).tolist()
        x_lo = int.from_bytes(bytes(v & 0xFF for v in x[:4]), "little")
        x_hi = int.from_bytes(bytes(v & 0xFF for v in x[4:]), "little")
        lo, hi = _codes_asm(w)
        assert _dp4a(hi, x_hi, _dp4a(lo, x_lo, 0)) == sum(TWICE[(w >> (4 * i)) & 15] * x[i] for i in range(8))


@pytest.mark.parametrize("config", [ExpertGemvConfig(block_m=2), ExpertGemvConfig(block_m=4, gate_up_rows=1),
                                    ExpertGemvConfig(block_m=8, gate_up_k_lanes=1, down_k_lanes=2, down_rows=4)],
                         ids=["m2", "m4_rows1", "m8_k_lanes"])
@pytest.mark.parametrize("num_tokens", [5, 13], ids=lambda t: f"T{t}")
def test_matches_the_reference(num_tokens, config):
    """Experts 1 and 5 get no pairs, expert 2 every token (several blocks of it at block_m 2 / 4),
    the others one or a few pairs; exact in fp32 (the block sums are exact, only their order of
    addition differs from the reference)."""
    g = torch.Generator().manual_seed(num_tokens)
    x, w13, s13, w2, s2, weights, ids = _moe_case(num_tokens, 3, g)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids.to(torch.int32), True, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))


def test_several_k_steps_and_an_id_out_of_range():
    """H of 36 blocks over 16 lanes (three K steps, the last partly masked), I of 3 blocks; an id
    out of range adds nothing (the alignment drops it; the slot sum skips its unwritten row)."""
    g = torch.Generator().manual_seed(30)
    x, w13, s13, w2, s2, weights, ids = _moe_case(3, 2, g, hot=3, hidden=36 * 32, inter=96)
    ids[1, 1] = EXPERTS
    ids[2, 0] = -1
    config = ExpertGemvConfig(block_m=2, gate_up_warps=1, gate_up_k_lanes=16, down_warps=1)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))


def test_e8m0_bytes_0_and_254():
    g = torch.Generator().manual_seed(12)
    x, w13, s13, w2, s2, weights, ids = _moe_case(4, 2, g, hot=3)
    w13, s13, x = _with_extreme_scales(w13, s13, x, g)
    ref = _moe_reference(x, w13, s13, w2, s2, weights, ids, True)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    _close(fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=ExpertGemvConfig()), ref)


def test_a_nan_activation_reaches_its_token_only():
    """A NaN in x makes that token's activation block NaN (scale byte 255): its output is NaN,
    the other tokens', sharing its experts, are not."""
    g = torch.Generator().manual_seed(40)
    x, w13, s13, w2, s2, weights, ids = _moe_case(3, 2, g, hot=4)
    x[1, 7] = float("nan")
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=ExpertGemvConfig())
    assert out[1].isnan().all()
    ref = _moe_reference(x[[0, 2]], w13, s13, w2, s2, weights[[0, 2]], ids[[0, 2]], True)
    _close(out[[0, 2]], ref)


def test_with_a_fused_shared_expert_slot():
    """Kimi's routing with the shared expert as expert E at weight 1.0 in a ninth slot: every
    token's pairs of it fill whole blocks."""
    from model_ops.moe import append_shared_expert

    g = torch.Generator().manual_seed(15)
    num_tokens, routed = 7, EXPERTS
    w13, s13 = _random_mxfp4(routed + 1, 2 * INTER, HIDDEN, g=g, low=120, high=126)
    w2, s2 = _random_mxfp4(routed + 1, HIDDEN, INTER, g=g, low=120, high=126)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(routed, generator=g) for _ in range(num_tokens)])
    weights, ids = append_shared_expert(torch.rand(num_tokens, routed, generator=g) * 2.5, ids, routed)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, out=nan_like(x), config=ExpertGemvConfig())
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))


def test_bfloat16():
    g = torch.Generator().manual_seed(32)
    x, w13, s13, w2, s2, weights, ids = _moe_case(6, 2, g)
    ref = _moe_reference(x.bfloat16(), w13, s13, w2, s2, weights, ids, True).float()
    out = fused_moe_mxfp4(x.bfloat16(), w13, s13, w2, s2, weights, ids, True, config=ExpertGemvConfig(block_m=4))
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


def test_default_config_follows_the_pairs_an_expert_gets():
    assert default_config(64 * 9, 385, 256) == ExpertGemvConfig(block_m=2, gate_up_rows=4, down_rows=8)
    assert default_config(128 * 9, 385, 256) == ExpertGemvConfig(block_m=4, gate_up_rows=4, down_rows=4)
    assert default_config(128 * 8, 384, 2048) == ExpertGemvConfig(block_m=4, gate_up_rows=4, down_rows=8)
    assert default_config(4096 * 9, 385, 256).block_m == 4  # 8 pairs a block measured slower at every T


def test_refuses_bad_configs_and_bf16_activations():
    g = torch.Generator().manual_seed(33)
    x, w13, s13, w2, s2, weights, ids = _moe_case(2, 2, g)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=ExpertGemvConfig(block_m=3))
    with pytest.raises(ValueError, match="down_warps"):
        fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=ExpertGemvConfig(down_warps=16))
    with pytest.raises(ValueError, match="quantize_activations"):
        fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, False, config=ExpertGemvConfig())
