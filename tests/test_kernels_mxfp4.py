"""kernels_rocm.mxfp4_linear and kernels_rocm.mxfp4_moe against the dequantize reference
(model_ops.quant.mxfp4), in fp32 under the interpreter (fp32 dot operands there).

Expected results are computed the way the contract states them: activations through
qdq_mxfp4 when quantized, weights through dequantize_mxfp4, fp32 GEMMs. The kernels differ
only by fp32 accumulation order (tolerance 1e-5 relative to the output scale); where no
rounding is involved (the QDQ itself) the comparison is exact. About 1-3 s per MoE case.
"""
from __future__ import annotations

import dataclasses
import functools
import unittest.mock

import pytest
import torch
import torch.nn.functional as F

from _kernel_cases import nan_like
from kernels_rocm._mxfp4 import FOLD_MAX_SCALE_BYTE, foldable_scales
from kernels_rocm.mxfp4_linear import GemmConfig, mxfp4_linear
from kernels_rocm import mxfp4_linear as mxfp4_linear_mod
from kernels_rocm.mxfp4_moe import (DECODE_MAX_TOKENS, PREFILL_PAIRS_PER_EXPERT, MoeConfig, default_config,
                                     fused_moe_mxfp4, prefill_config, qdq_rows)
from kernels_rocm import mxfp4_moe_decode
from kernels_rocm.mxfp4_moe_decode import DecodeConfig
from model_ops.quant.mxfp4 import dequantize_mxfp4, qdq_mxfp4, quantize_mxfp4


def _random_mxfp4(*shape, g, low=118, high=132):
    """Random packed codes (every nibble value) and E8M0 scale bytes in [low, high)."""
    packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g).to(torch.uint8)
    scale = torch.randint(low, high, (*shape[:-1], shape[-1] // 32), generator=g).to(torch.uint8)
    return packed, scale


def _close(out, ref, tol=1e-5):
    assert torch.isfinite(out).all(), "non-finite output (unwritten poison?)"
    torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=tol)


def _with_extreme_scales(packed, scale, x, g):
    """Give one 32-block of every row scale byte 0 (2^-127) and another byte 254 (2^127).

    The matching activation columns are scaled by 2^120 / 2^-126 so those blocks contribute
    O(1) to the output: a kernel that decoded byte 0 as zero, or 254 inexactly, or overflowed,
    fails. Under byte 254 only codes of magnitude <= 1.5 are kept (2 * 2^127 is inf in fp32)."""
    scale[..., 0] = 0
    scale[..., -1] = 254
    tail = packed[..., -16:]
    packed[..., -16:] = tail & 0xBB  # clear each nibble's top exponent bit: magnitudes 0..1.5
    x = x.clone()
    x[:, :32] *= 2.0**120
    x[:, -32:] *= 2.0**-126
    return packed, scale, x


# ------------------------------------------------------------------------------------ Linear

def _linear_reference(x, packed, scale, bias, quantize):
    a = qdq_mxfp4(x) if quantize else x
    out = a.float() @ dequantize_mxfp4(packed, scale).T
    return (out + bias.float() if bias is not None else out).to(x.dtype)


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("config", [None, GemmConfig(16, 16, 32, split_k=2), GemmConfig(32, 32, 64, split_k=1)],
                         ids=["default", "split2", "bm32"])
def test_linear_matches_reference(quantize, config):
    g = torch.Generator().manual_seed(0)
    m, n, k = 5, 48, 160  # odd M, N not a multiple of the tiles, K = 5 blocks
    packed, scale = _random_mxfp4(n, k, g=g)
    x = torch.randn(m, k, generator=g) * 3
    bias = torch.randn(n, generator=g)
    out = mxfp4_linear(x, packed, scale, bias, quantize_activations=quantize, config=config,
                       out=nan_like(torch.empty(m, n)))
    _close(out, _linear_reference(x, packed, scale, bias, quantize))


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("tiles", mxfp4_linear_mod.WIDE_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_linear_wide_tiles_match_reference(quantize, tiles):
    """The NVIDIA tiles for many rows (WIDE_TILES, block_k 64) on a partial M and N tile and K = 5 blocks."""
    g = torch.Generator().manual_seed(9)
    bm, bn, warps = tiles
    m, n, k = bm + 3, bn + 40, 160
    packed, scale = _random_mxfp4(n, k, g=g)
    x = torch.randn(m, k, generator=g) * 3
    out = mxfp4_linear(x, packed, scale, quantize_activations=quantize, out=nan_like(torch.empty(m, n)),
                       config=GemmConfig(bm, bn, 64, 1, num_warps=warps, num_stages=3))
    _close(out, _linear_reference(x, packed, scale, None, quantize))


def test_linear_default_config_takes_wide_tiles_while_they_fill_half_the_sms(monkeypatch):
    """At Kimi TP8's dense MLP shapes on a 132-SM GPU (the H100 sweep's choices): 128 x 256 from M = 512,
    128 x 128 at M = 256, 64 x 128 at M = 128 on N = 7168; the small-M tiles below that; AMD never."""
    monkeypatch.setattr(mxfp4_linear_mod, "num_compute_units", lambda device: 132)
    pick = lambda m, n, k: mxfp4_linear_mod.default_config(m, n, k, torch.device("cpu"))  # noqa: E731
    assert (pick(8192, 4608, 7168).block_m, pick(8192, 4608, 7168).block_n) == (128, 256)
    assert (pick(512, 4608, 7168).block_m, pick(512, 4608, 7168).block_n) == (128, 256)
    assert (pick(256, 4608, 7168).block_m, pick(256, 4608, 7168).block_n) == (128, 128)
    assert (pick(128, 7168, 2304).block_m, pick(128, 7168, 2304).block_n) == (64, 128)
    assert (pick(2048, 512, 7168).block_m, pick(2048, 512, 7168).block_n) == (64, 128)
    assert (pick(64, 4608, 7168).block_m, pick(64, 4608, 7168).block_n) == (64, 64)  # 36 programs: too few
    assert pick(8, 4608, 7168).block_m == 16
    monkeypatch.setattr(mxfp4_linear_mod, "IS_HIP", True)
    assert (pick(8192, 4608, 7168).block_m, pick(8192, 4608, 7168).block_n) == (64, 64)


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
def test_linear_e8m0_bytes_0_and_254(quantize):
    g = torch.Generator().manual_seed(1)
    packed, scale = _random_mxfp4(24, 96, g=g)
    packed, scale, x = _with_extreme_scales(packed, scale, torch.randn(3, 96, generator=g), g)
    assert (scale == 0).any() and (scale == 254).any()
    out = mxfp4_linear(x, packed, scale, None, quantize_activations=quantize)
    ref = _linear_reference(x, packed, scale, None, quantize)
    assert ref.abs().max() > 1e-3 and torch.isfinite(ref).all()
    _close(out, ref)


def _with_fold_edge_scales(packed, scale, x):
    """Scale bytes at the ends of what folds: one 32-block of every row at byte 0 (2^-127, the fold's
    multiplier 2^-1), another at FOLD_MAX_SCALE_BYTE (2^1, multiplier 2^127); x's block 0 scaled by
    2^120 so that it weighs in the output."""
    scale[..., 0] = 0
    scale[..., -1] = FOLD_MAX_SCALE_BYTE
    x = x.clone()
    x[:, :32] *= 2.0**120
    return packed, scale, x


def test_foldable_scales():
    assert foldable_scales(torch.tensor([0, 127, FOLD_MAX_SCALE_BYTE], dtype=torch.uint8))
    assert not foldable_scales(torch.tensor([[120], [FOLD_MAX_SCALE_BYTE + 1]], dtype=torch.uint8))
    assert not foldable_scales(torch.zeros(3, dtype=torch.uint8), torch.tensor([254], dtype=torch.uint8))
    assert foldable_scales(torch.zeros(0, dtype=torch.uint8))


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("config", [None, GemmConfig(16, 16, 32, split_k=2)], ids=["default", "split2"])
def test_linear_folded_scales_match_reference(quantize, config):
    """fold_scales: each scale applied in the decode's one multiply, exact over the bytes that fold."""
    g = torch.Generator().manual_seed(3)
    packed, scale = _random_mxfp4(40, 128, g=g, low=110, high=FOLD_MAX_SCALE_BYTE + 1)
    packed, scale, x = _with_fold_edge_scales(packed, scale, torch.randn(5, 128, generator=g))
    assert foldable_scales(scale)
    out = mxfp4_linear(x, packed, scale, None, quantize_activations=quantize, config=config, fold_scales=True)
    ref = _linear_reference(x, packed, scale, None, quantize)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    _close(out, ref)


def _qdq_probe_rows(g):
    """Activation rows that stress the "even" rule: E2M1 ties, amax at and around 1.75 * 2^n
    (where the scale moves up), zero / subnormal / huge blocks, signed zeros, NaN and inf."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.5, 100.0])
    rows = []
    for n in (-3, 0, 7):
        block = torch.cat([grid, ties, -ties, grid[:4]]) * 2.0**n  # 32 values, amax 100 * 2^n
        rows.append(block)
        rows.append(torch.cat([ties[:3], torch.full((29,), 1.75)]) * 2.0**n)  # amax exactly 1.75 * 2^n
        rows.append(torch.cat([ties[:3], torch.full((29,), 1.7499999)]) * 2.0**n)  # just below
    rows.append(torch.zeros(32))
    rows.append(torch.full((32,), -0.0))
    rows.append(torch.randn(32, generator=g) * 2.0**-140)  # fp32 subnormals
    rows.append(torch.randn(32, generator=g) * 2.0**126)
    rows.append(torch.randn(32, generator=g).masked_fill(torch.arange(32) == 5, float("nan")))
    rows.append(torch.randn(32, generator=g).masked_fill(torch.arange(32) == 9, float("-inf")))
    blocks = torch.stack(rows)  # [R, 32]: make rows of 4 blocks, shuffled across rows
    blocks = blocks[torch.randperm(blocks.shape[0], generator=g)]
    blocks = torch.cat([blocks, torch.randn(-blocks.shape[0] % 4, 32, generator=g)])
    return blocks.reshape(-1, 128)


def test_fused_activation_qdq_is_exact():
    """Through an identity weight the output is the QDQ'd activation itself: equal to qdq_mxfp4
    bit for bit. A NaN block (from NaN or inf) turns its whole output row NaN (NaN * 0 in the
    dot), so those rows are only checked for NaN."""
    x = _qdq_probe_rows(torch.Generator().manual_seed(2))
    packed, scale = quantize_mxfp4(torch.eye(128))
    assert torch.equal(dequantize_mxfp4(packed, scale), torch.eye(128))
    out = mxfp4_linear(x, packed, scale, None, quantize_activations=True)
    expected = qdq_mxfp4(x)
    nan_rows = torch.isnan(expected).any(dim=1)
    assert nan_rows.sum() == 2 and torch.isnan(out[nan_rows]).all()
    assert torch.equal(out[~nan_rows], expected[~nan_rows])


def test_linear_bfloat16():
    g = torch.Generator().manual_seed(3)
    packed, scale = _random_mxfp4(40, 64, g=g)
    x = torch.randn(7, 64, generator=g)
    out = mxfp4_linear(x.bfloat16(), packed, scale, None, quantize_activations=True)
    ref = _linear_reference(x.bfloat16(), packed, scale, None, True).float()
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


@pytest.mark.parametrize(
    "args,match",
    [
        (lambda p, s, x: (x, p.float(), s), "weight"),
        (lambda p, s, x: (x, p, s[:, :1]), "weight_scale"),
        (lambda p, s, x: (x, p, s.int()), "weight_scale"),
        (lambda p, s, x: (x[:, :48], p, s), "K must be a multiple"),
        (lambda p, s, x: (x[:, :32], p, s), "weight"),
    ],
)
def test_linear_rejects(args, match):
    g = torch.Generator().manual_seed(4)
    packed, scale = _random_mxfp4(8, 64, g=g)
    with pytest.raises(ValueError, match=match):
        mxfp4_linear(*args(packed, scale, torch.randn(2, 64)), quantize_activations=False)


# --------------------------------------------------------------------------------------- MoE

EXPERTS, HIDDEN, INTER = 8, 64, 96  # INTER = 3 blocks: not a multiple of the 64-wide tiles


def _moe_reference(x, w13, s13, w2, s2, topk_weights, topk_ids, quantize):
    """The contract's loop, per (token, slot); ids outside [0, E) add nothing."""
    inter = w13.shape[1] // 2
    a = qdq_mxfp4(x) if quantize else x
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = a[t].float() @ dequantize_mxfp4(w13[e], s13[e]).T
            h = (F.silu(gate_up[:inter]) * gate_up[inter:]).to(x.dtype)
            if quantize:
                h = qdq_mxfp4(h)
            out[t] += topk_weights[t, k] * (h.float() @ dequantize_mxfp4(w2[e], s2[e]).T)
    return out.to(x.dtype)


def _moe_case(num_tokens, top_k, g, skip=(1, 5), hot=2, hidden=HIDDEN, inter=INTER):
    """Experts in `skip` get no tokens; `hot` is every token's first pick."""
    w13, s13 = _random_mxfp4(EXPERTS, 2 * inter, hidden, g=g, low=120, high=126)
    w2, s2 = _random_mxfp4(EXPERTS, hidden, inter, g=g, low=120, high=126)
    x = torch.randn(num_tokens, hidden, generator=g)
    allowed = torch.tensor([e for e in range(EXPERTS) if e not in skip and e != hot])
    picks = torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[: top_k - 1]] for _ in range(num_tokens)])
    ids = torch.cat([torch.full((num_tokens, 1), hot), picks], dim=1)
    weights = torch.rand(num_tokens, top_k, generator=g)
    return x, w13, s13, w2, s2, (weights / weights.sum(-1, keepdim=True)).contiguous(), ids


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("num_tokens", [1, 5, 13], ids=lambda t: f"T{t}")
def test_moe_matches_reference(num_tokens, quantize):
    g = torch.Generator().manual_seed(num_tokens)
    x, w13, s13, w2, s2, weights, ids = _moe_case(num_tokens, 3, g)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids.to(torch.int32), quantize, out=nan_like(x))
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))


@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_moe_with_a_fused_shared_expert_slot(path):
    """Kimi's routing with its shared expert fused (model_ops.moe.append_shared_expert): 8 routed
    slots plus expert E = 8 at weight 1.0 on every token, 9 slots (the decode path's unrolled
    TOP_K), W4A4, against the reference and against routed + shared run separately."""
    from model_ops.moe import append_shared_expert

    g = torch.Generator().manual_seed(15)
    num_tokens, routed = 3, EXPERTS
    w13, s13 = _random_mxfp4(routed + 1, 2 * INTER, HIDDEN, g=g, low=120, high=126)
    w2, s2 = _random_mxfp4(routed + 1, HIDDEN, INTER, g=g, low=120, high=126)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(routed, generator=g) for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, routed, generator=g) * 2.5
    weights, ids = append_shared_expert(weights, ids, routed)
    config = DecodeConfig() if path == "decode" else default_config(num_tokens, routed + 1, routed + 1, HIDDEN,
                                                                    INTER, x.device)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))
    alone = [fused_moe_mxfp4(x, w13, s13, w2, s2, weights[:, cols].contiguous(), ids[:, cols].contiguous(), True,
                             config=config) for cols in (slice(0, routed), slice(routed, None))]
    _close(out, alone[0] + alone[1])


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("pairs_per_expert", [40, 100], ids=["bm64", "bm128"])
def test_moe_prefill_tiles_match_reference(quantize, pairs_per_expert):
    """`prefill_config`'s tiles (64- and 128-row M blocks, 128 x 64 / 128 x 128 / 256 x 64) against the
    reference, with 70 tokens over 6 experts (two M blocks for the hot expert, experts with none)."""
    g = torch.Generator().manual_seed(12)
    x, w13, s13, w2, s2, weights, ids = _moe_case(70, 2, g)
    config = prefill_config(pairs_per_expert)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))


def test_moe_default_config_takes_the_prefill_tiles_past_32_pairs_an_expert(monkeypatch):
    """Kimi TP8 (384 experts, top-8): T = 1,536 is 32 pairs an expert (the small-M tiles), 2,048 is 42.7
    (64-row blocks), 8,192 is 170.7 (128-row blocks); AMD keeps the small-M tiles."""
    pick = lambda t: default_config(t, 8, 384, 7168, 256, torch.device("cpu"))  # noqa: E731
    assert PREFILL_PAIRS_PER_EXPERT == 32
    assert pick(1536).gate_up.block_m == 32
    assert pick(2048) == prefill_config(2048 * 8 / 384) and pick(2048).gate_up.block_m == 64
    assert pick(8192) == prefill_config(8192 * 8 / 384) and pick(8192).down.block_m == 128
    # fp32 activations: the prefill tiles' shared memory would not fit an sm_90 program
    assert default_config(8192, 8, 384, 7168, 256, torch.device("cpu"), torch.float32).gate_up.block_m == 64
    assert default_config(8192, 8, 384, 7168, 256, torch.device("cpu"), torch.float32) != pick(8192)
    monkeypatch.setattr("kernels_rocm.mxfp4_moe.IS_HIP", True)
    assert pick(8192).gate_up.block_m == 64 and pick(8192).gate_up.block_n == 64


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
def test_moe_split_k_and_tiles(quantize):
    """The split-K path (partials summed by the epilogue kernel) and other tiles, int64 ids."""
    g = torch.Generator().manual_seed(11)
    x, w13, s13, w2, s2, weights, ids = _moe_case(6, 2, g)
    config = MoeConfig(gate_up=GemmConfig(16, 32, 32, split_k=2), down=GemmConfig(16, 32, 64))
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("n_tiles", [2, 4], ids=lambda n: f"{n}_tiles")
def test_moe_down_programs_walk_n_tiles(n_tiles, quantize):
    """GEMM 2 programs that walk several N tiles (MoeConfig.down_n_tiles): H = 160 is 3 tiles of 64
    with the last half masked, so with 2 tiles a program the second program walks one tile and
    with 4 one program walks all three; I = 96 over K tiles of 64 gives two K steps a tile, the
    second half masked. Experts 1 and 5 get no tokens; equal to the one-tile-a-program launch."""
    g = torch.Generator().manual_seed(40 + n_tiles)
    hidden = 160
    x, w13, s13, w2, s2, weights, ids = _moe_case(7, 3, g, hidden=hidden)
    base = MoeConfig(gate_up=GemmConfig(16, 64, 64), down=GemmConfig(16, 64, 64))
    config = dataclasses.replace(base, down_n_tiles=n_tiles)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))
    _close(out, fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, config=base))


@pytest.mark.parametrize("path", ["grouped", "decode"])
def test_moe_e8m0_bytes_0_and_254(path):
    g = torch.Generator().manual_seed(12)
    x, w13, s13, w2, s2, weights, ids = _moe_case(4, 2, g, hot=3)
    w13, s13, x = _with_extreme_scales(w13, s13, x, g)
    assert (s13 == 0).any() and (s13 == 254).any()
    config = DecodeConfig() if path == "decode" else default_config(4, 2, EXPERTS, HIDDEN, INTER, x.device)
    ref = _moe_reference(x, w13, s13, w2, s2, weights, ids, False)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    _close(fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, False, config=config), ref)


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
def test_moe_folded_scales_match_reference(quantize):
    """The grouped GEMMs with fold_scales (GEMM 2 walking N tiles too), scale bytes 0 and 128 included."""
    g = torch.Generator().manual_seed(13)
    x, w13, s13, w2, s2, weights, ids = _moe_case(9, 3, g)
    w13, s13, x = _with_fold_edge_scales(w13, s13, x)
    s2[..., -1] = FOLD_MAX_SCALE_BYTE
    assert foldable_scales(s13, s2)
    config = MoeConfig(gate_up=GemmConfig(16, 64, 64), down=GemmConfig(16, 32, 32), down_n_tiles=2)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, out=nan_like(x), config=config,
                          fold_scales=True)
    ref = _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e-3
    _close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qdq_rows_equals_reference(dtype):
    """The grouped path's once-per-call activation QDQ equals qdq_mxfp4 exactly: odd rows, a width
    of 5 blocks (the 256-wide tile's tail masked), a block of zeros, values past 6 * 2^k."""
    g = torch.Generator().manual_seed(25)
    x = (torch.randn(7, 160, generator=g) * 40).to(dtype)
    x[2, 32:64] = 0
    assert torch.equal(qdq_rows(x), qdq_mxfp4(x))


def test_moe_bfloat16():
    g = torch.Generator().manual_seed(13)
    x, w13, s13, w2, s2, weights, ids = _moe_case(5, 2, g)
    ref = _moe_reference(x.bfloat16(), w13, s13, w2, s2, weights, ids, True).float()
    out = fused_moe_mxfp4(x.bfloat16(), w13, s13, w2, s2, weights, ids, True)
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


def test_moe_rejects_bad_shapes():
    g = torch.Generator().manual_seed(14)
    x, w13, s13, w2, s2, weights, ids = _moe_case(2, 2, g)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe_mxfp4(x, w13, s13[..., :1], w2, s2, weights, ids, False)
    with pytest.raises(ValueError, match="w2"):
        fused_moe_mxfp4(x, w13, s13, w2[:, :, :8], s2[:, :, :1], weights, ids, False)
    with pytest.raises(ValueError, match="w13"):
        fused_moe_mxfp4(x, w13.float(), s13, w2, s2, weights, ids, False)


# ------------------------------------------------------------------------- MoE decode path

@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("num_tokens", [1, 2, 3], ids=lambda t: f"T{t}")
def test_moe_decode_matches_reference_and_grouped(num_tokens, quantize):
    """The decode path (taken by default at these T, W4A16 and W4A4) against the reference and
    the grouped GEMMs. Every token's first pick is expert 7 (odd, shared by all tokens); the
    others odd or even."""
    assert num_tokens <= DECODE_MAX_TOKENS[False]
    g = torch.Generator().manual_seed(20 + num_tokens)
    x, w13, s13, w2, s2, weights, ids = _moe_case(num_tokens, 3, g, skip=(0,), hot=7)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids.to(torch.int32), quantize, out=nan_like(x))
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))
    grouped = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize,
                              config=default_config(num_tokens, 3, EXPERTS, HIDDEN, INTER, x.device))
    _close(out, grouped)


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
def test_moe_decode_several_k_steps_and_row_tiles(quantize):
    """H of 36 blocks over 32 lanes (one warp): two K steps, the second partly masked (a row tile
    past I, whose rows re-read the last row and are never stored, is in the test above: 128
    rows over I = 96); an id out of range adds nothing, as in the grouped path."""
    g = torch.Generator().manual_seed(30)
    hidden, inter = 36 * 32, 96
    x, w13, s13, w2, s2, weights, ids = _moe_case(2, 2, g, hot=3, hidden=hidden, inter=inter)
    ids[1, 1] = EXPERTS
    config = DecodeConfig(gate_up_rows=8, gate_up_warps=1, down_rows=8, down_warps=1)  # 64-row tiles
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
def test_moe_decode_rocm_tiles(quantize, monkeypatch):
    """The ROCm launch (wave64 lanes, the slot loop not unrolled), run by the interpreter."""
    monkeypatch.setattr(mxfp4_moe_decode, "IS_HIP", True)
    g = torch.Generator().manual_seed(33)
    x, w13, s13, w2, s2, weights, ids = _moe_case(2, 3, g, hot=5)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, out=nan_like(x))
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))


@pytest.mark.parametrize("ahead", [1, 3, 12], ids=lambda a: f"ahead{a}")
def test_moe_decode_kernel_2_loads_ahead(ahead):
    """Kernel 2 issuing each (slot, K step)'s loads `ahead` units early (W4A4; 2 lanes along I = 3
    blocks: 2 K steps a slot, the second half masked; 12 = all units): against the reference, and bit
    for bit the loads in turn (the same sums in the same order)."""
    config = DecodeConfig(down_warps=1, down_k_lanes=2, down_ahead=ahead)
    g = torch.Generator().manual_seed(35)
    x, w13, s13, w2, s2, weights, ids = _moe_case(3, 3, g, hot=4)
    ids[1, 2] = -1  # out of range: adds nothing
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, out=nan_like(x), config=config)
    _close(out, _moe_reference(x, w13, s13, w2, s2, weights, ids, True))
    in_turn = dataclasses.replace(config, down_ahead=0)
    assert torch.equal(out, fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=in_turn))


def test_moe_decode_default_config_by_token_count():
    """The W4A4 launch shapes by program count (a device of 132 SMs): a TP8 rank's T = 1 keeps kernel
    1's 2 rows a lane, T = 2 takes 4 rows on 2 warps, T = 4 and full width 16-row tiles; kernel 2
    loads 4 slots ahead with 2 rows a lane while 4 rows would give under 2 programs an SM (TP8 T <= 2),
    else 4 rows; W4A16 keeps DecodeConfig()."""
    device = torch.device("cpu")
    with unittest.mock.patch.object(mxfp4_moe_decode, "num_compute_units", lambda _: 132):
        pick = functools.partial(mxfp4_moe_decode.default_config, top_k=8, hidden=7168, device=device)
        assert pick(1, inter=256, quantize_activations=True) == DecodeConfig(down_ahead=4)
        assert pick(2, inter=256, quantize_activations=True) == DecodeConfig(gate_up_rows=4, gate_up_warps=2,
                                                                               down_ahead=4)
        tiles = DecodeConfig(gate_up_rows=4, gate_up_k_lanes=32, down_rows=4)
        assert pick(4, inter=256, quantize_activations=True) == tiles
        assert pick(1, inter=2048, quantize_activations=True) == tiles
        assert pick(4, inter=256, quantize_activations=False) == DecodeConfig()


def test_moe_decode_bfloat16():
    """(A seed whose h has no bf16 / E2M1 rounding tie that the two summation orders split: at
    seed 31 both paths differ from the reference by 5.5% of the max at one h element, alike.)"""
    g = torch.Generator().manual_seed(32)
    x, w13, s13, w2, s2, weights, ids = _moe_case(3, 2, g)
    ref = _moe_reference(x.bfloat16(), w13, s13, w2, s2, weights, ids, True).float()
    out = fused_moe_mxfp4(x.bfloat16(), w13, s13, w2, s2, weights, ids, True, config=DecodeConfig())
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


def test_moe_decode_rejects_bad_config():
    g = torch.Generator().manual_seed(32)
    x, w13, s13, w2, s2, weights, ids = _moe_case(1, 2, g)
    with pytest.raises(ValueError, match="gate_up_rows"):
        fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, False, config=DecodeConfig(gate_up_rows=3))
    with pytest.raises(ValueError, match="down_warps"):
        fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, False, config=DecodeConfig(down_warps=16))
    with pytest.raises(ValueError, match="gate_up_k_lanes"):
        fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=DecodeConfig(gate_up_k_lanes=24))


def test_layers_bind_fold_scales_after_loading():
    """The Triton MXFP4 layers check their scales once after loading and pass fold_scales to every call."""
    from model_ops.quant.mxfp4_layers import MXFP4Experts, MXFP4Linear, mxfp4_linear_reference

    g = torch.Generator().manual_seed(21)
    experts = MXFP4Experts(EXPERTS, HIDDEN, INTER, quantize_activations=True, backend="triton")
    x, w13, s13, w2, s2, weights, ids = _moe_case(3, 2, g)
    for name, value in dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2).items():
        getattr(experts, name).data.copy_(value)
    experts.process_weights_after_loading()
    assert experts.impl.keywords == {"fold_scales": True}
    _close(experts(x, weights, ids), _moe_reference(x, w13, s13, w2, s2, weights, ids, True))

    linear = MXFP4Linear(64, 24)
    assert linear.impl is mxfp4_linear_reference  # on CPU: nothing to bind
    linear.process_weights_after_loading()
    assert linear.impl is mxfp4_linear_reference
    linear.impl = mxfp4_linear  # as on a GPU
    packed, scale = _random_mxfp4(24, 64, g=g)
    scale[3, 1] = FOLD_MAX_SCALE_BYTE + 1  # one scale of 4: the fold would overflow
    linear.weight.data.copy_(packed)
    linear.weight_scale.data.copy_(scale)
    linear.process_weights_after_loading()
    assert linear.impl.keywords == {"fold_scales": False}
    x = torch.randn(2, 64, generator=g)
    _close(linear(x), _linear_reference(x, packed, scale, None, True))
