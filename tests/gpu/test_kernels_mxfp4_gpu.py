"""Compiled MXFP4 GEMMs and FP8-KV attention against the fp32 references at model sizes (GPU).

Run: python -m pytest tests/gpu/test_kernels_mxfp4_gpu.py -q   (about 1-2 minutes on an H100,
mostly compilation; peak memory about 12 GB).

Tolerance as in test_kernels_gpu.py: bf16 kernels vs fp32 references built from the same inputs
(weights dequantized by model_ops.quant.mxfp4, activations QDQ'd by qdq_mxfp4, fp8 caches
dequantized by model_ops.quant.fp8), relative error ||out - ref|| / ||ref|| < 1e-2, all finite.
Sizes: Kimi-K2.5 TP8 rank (E384, top-8, H7168, I256) and the full expert width (I2048, fewer
experts to bound memory), the TP8 shared-expert and dense shapes, Kimi MLA 8 heads 512+64 with
fp8 latent rows in a pool past 4 GiB (block ids >= 65,536) and the CUDA fp8 upcast for every
byte, the EAGLE3 MHA draft; graph capture and replay with new routing / new scale values; the
MoE's decode path (T <= decode_max_tokens(I, W4A4)) against the grouped path forced at the same inputs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from _kernel_cases import make_metadata, metadata_args  # tests/ is on sys.path via tests/conftest.py
from kernels_rocm._mxfp4 import (FOLD_MAX_SCALE_BYTE, e2m1_pair_placed_bf16_ptx, e2m1_pair_to_bf16_ptx, e8m0_folded_bf16,
                                  e8m0_to_bf16, foldable_scales)
from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from kernels_rocm.mla_decode import e4m3fn_to_f16_ptx, mla_paged_attention
from kernels_rocm.mxfp4_linear import mxfp4_linear
from kernels_rocm.mxfp4_moe import decode_max_tokens, fused_moe_mxfp4
from kernels_rocm.mxfp4_moe import default_config as moe_default_config
from kernels_rocm.mxfp4_moe_decode import DecodeConfig, _e2m1_dot
from kernels_rocm.mxfp4_moe_expert_gemv import default_config as expert_default_config
from kernels_rocm.mxfp4_moe_expert_gemv import dp4a_pair_ptx, e2m1_codes_ptx
from kernels_rocm.paged_attention import paged_attention
from model_ops.attention import torch_ref
from model_ops.attention.metadata import AttentionMetadata
from model_ops.quant.fp8 import dequantize_fp8, quantize_fp8
from model_ops.quant.mxfp4 import dequantize_mxfp4, qdq_mxfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

DEVICE = "cuda"
REL_TOL = 1e-2


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float = REL_TOL) -> None:
    out = out.float()
    assert torch.isfinite(out).all(), "output has non-finite elements"
    rel = ((out - ref.float()).norm() / ref.float().norm()).item()
    assert rel < tol, f"relative error {rel:.3e} >= {tol}"


def random_mxfp4(*shape, g, low=116, high=124):
    """Packed random codes and E8M0 bytes around the scales of real LLM weights (2^-11 .. 2^-4)."""
    packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, device=DEVICE, dtype=torch.uint8)
    scale = torch.randint(low, high, (*shape[:-1], shape[-1] // 32), generator=g, device=DEVICE, dtype=torch.uint8)
    return packed, scale


def moe_reference(x, w13, s13, w2, s2, topk_weights, topk_ids, quantize):
    """The contract's semantics in fp32 (bf16 roundings of the activations kept), looping over
    the experts hit."""
    inter = w13.shape[1] // 2
    a = qdq_mxfp4(x) if quantize else x
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = a[token].float() @ dequantize_mxfp4(w13[e], s13[e]).T
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        if quantize:
            h = qdq_mxfp4(h)
        y = h.float() @ dequantize_mxfp4(w2[e], s2[e]).T
        out.index_add_(0, token, y * topk_weights[token, slot, None])
    return out


MOE_SHAPES = {"kimi_tp8": (384, 8, 7168, 256), "kimi_full_width_e32": (32, 8, 7168, 2048)}


def moe_inputs(shape, num_tokens, seed=0):
    num_experts, top_k, hidden, inter = MOE_SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13, s13 = random_mxfp4(num_experts, 2 * inter, hidden, g=g)
    w2, s2 = random_mxfp4(num_experts, hidden, inter, g=g)
    x = torch.randn(num_tokens, hidden, generator=g, device=DEVICE).bfloat16()
    scores = torch.rand(num_tokens, num_experts, generator=g, device=DEVICE)
    weights, ids = scores.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
    return x, w13, s13, w2, s2, weights, ids.to(torch.int32).contiguous()


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 256, 2048, 8192])  # 2048 / 8192: prefill_config's tiles
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_fused_moe_mxfp4(shape, num_tokens, quantize):
    x, w13, s13, w2, s2, weights, ids = moe_inputs(shape, num_tokens)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize,
                          out=torch.full_like(x, float("nan")))
    assert_rel_close(out, moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("num_tokens", [256, 2048])  # the grouped GEMMs: 16-row blocks walking N tiles, prefill tiles
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_fused_moe_mxfp4_folded_scales_bit_for_bit(shape, num_tokens, quantize):
    """fold_scales gives the unfolded kernels' output bit for bit (the same decoded values, the same
    dots), at realistic scales and with bytes 0 and FOLD_MAX_SCALE_BYTE in every row."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(shape, num_tokens)
    s13[..., 0], s2[..., 0], s13[..., -1] = 0, 0, FOLD_MAX_SCALE_BYTE
    assert foldable_scales(s13, s2)
    folded = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, fold_scales=True)
    plain = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize)
    assert torch.isfinite(plain).all() and torch.equal(folded, plain)


def test_e8m0_bytes_0_and_254_compiled():
    """Byte 0 (2^-127, an fp32 subnormal) and 254 (2^127) decode exactly in compiled code too
    (no flush to zero, no overflow): fp32 activations, fp32 dots."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    packed, scale = random_mxfp4(64, 128, g=g)
    scale[:, 0], scale[:, -1] = 0, 254
    packed[:, -16:] &= 0xBB  # magnitudes <= 1.5 under 2^127
    x = torch.randn(5, 128, generator=g, device=DEVICE)
    x[:, :32] *= 2.0**120
    x[:, -32:] *= 2.0**-126
    ref = x @ dequantize_mxfp4(packed, scale).T
    out = mxfp4_linear(x, packed, scale, None, quantize_activations=False)
    assert_rel_close(out, ref, tol=1e-5)


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize(("shape", "num_tokens", "down", "n_tiles"), [
    ("kimi_tp8", 300, dict(), 8),  # 112 N tiles: 14 programs an M block
    ("kimi_tp8", 300, dict(block_k=256), 16),  # one K step a tile
    ("kimi_tp8", 512, dict(block_n=128), 4),
    ("kimi_full_width_e32", 256, dict(), 28),  # K = 2048: 16 K steps a tile
], ids=["tp8_8_tiles", "tp8_16_tiles_k256", "tp8_4_tiles_n128", "full_28_tiles"])
def test_moe_down_programs_walking_n_tiles(shape, num_tokens, down, n_tiles, quantize):
    """GEMM 2 programs that walk several N tiles (MoeConfig.down_n_tiles, the bench sweep's
    variants): against the fp32 reference, and against one-tile programs with the same tiles
    (the same sums in the same order: equal up to a far tighter tolerance)."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs(shape, num_tokens, seed=9)
    base = moe_default_config(num_tokens, 8, w13.shape[0], 7168, w13.shape[1] // 2, x.device)
    down = dataclasses.replace(base.down, **{"block_n": 64, **down})  # the ids' tiles, whatever the default
    walk = dataclasses.replace(base, down=down, down_n_tiles=n_tiles)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, out=torch.full_like(x, float("nan")),
                          config=walk)
    assert_rel_close(out, moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))
    one_tile = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize,
                               config=dataclasses.replace(base, down=down))
    assert_rel_close(out, one_tile, tol=1e-5)


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_moe_decode_path_matches_grouped_path(num_tokens, quantize):
    """Both paths forced at the same Kimi TP8 inputs (bf16): the same values up to rounding."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs("kimi_tp8", num_tokens, seed=8)
    grouped = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize,
                              config=moe_default_config(num_tokens, 8, 384, 7168, 256, x.device))
    decode = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize, config=DecodeConfig())
    assert_rel_close(decode, grouped)


DECODE_W4A4_AHEAD = {
    "2_rows_ahead_4": DecodeConfig(down_ahead=4),
    "16_row_tiles_ahead_8": DecodeConfig(gate_up_rows=4, gate_up_k_lanes=32, down_rows=4, down_ahead=8),
}


@pytest.mark.parametrize("num_tokens", [1, 4, 32])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("name", list(DECODE_W4A4_AHEAD))
def test_moe_decode_kernel_2_loads_ahead_compiled(name, shape, num_tokens):
    """The decode path's kernel 2 issuing slots' loads ahead (down_ahead, W4A4), compiled and
    graph-replayed with new routing: against the fp32 reference, and bit for bit the loads in turn."""
    config = DECODE_W4A4_AHEAD[name]
    x, w13, s13, w2, s2, weights, ids = moe_inputs(shape, num_tokens, seed=15)
    graph, out = _capture(lambda: fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=config))
    for seed in (16, 17):
        _, _, _, _, _, new_weights, new_ids = moe_inputs(shape, num_tokens, seed=seed)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert_rel_close(out, moe_reference(x, w13, s13, w2, s2, weights, ids, True))
        in_turn = dataclasses.replace(config, down_ahead=0)
        assert torch.equal(out, fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, config=in_turn))


def test_moe_decode_e8m0_bytes_0_and_254_compiled():
    """The decode path's compiled weight decode (PTX, widened to fp32) on E8M0 bytes 0 and 254,
    fp32 activations: exact up to fp32 summation order."""
    g = torch.Generator(device=DEVICE).manual_seed(9)
    w13, s13 = random_mxfp4(4, 2 * 64, 128, g=g)
    w2, s2 = random_mxfp4(4, 128, 64, g=g)
    s13[..., 0], s13[..., -1] = 0, 254
    w13[..., -16:] &= 0xBB  # magnitudes <= 1.5 under 2^127
    x = torch.randn(2, 128, generator=g, device=DEVICE)
    x[:, :32] *= 2.0**120
    x[:, -32:] *= 2.0**-126
    ids = torch.tensor([[1, 3], [3, 2]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]], device=DEVICE)
    ref = moe_reference(x, w13, s13, w2, s2, weights, ids, False)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, False, config=DecodeConfig())
    assert_rel_close(out, ref, tol=1e-5)


@triton.jit
def _decode_probe_kernel(packed_ptr, scale_ptr, out_ptr, FOLD: tl.constexpr):
    """One 32-element block per program: the CUDA decode + bf16 scaling the GEMMs use (mxfp4_dot), with
    the scale apart or, FOLD, folded into the placement's multiply (fold_scales)."""
    row = tl.program_id(0)
    packed = tl.load(packed_ptr + row * 16 + tl.arange(0, 16))
    if FOLD:
        lo, hi = e2m1_pair_placed_bf16_ptx(packed)
        scale = e8m0_folded_bf16(tl.load(scale_ptr + row))
    else:
        lo, hi = e2m1_pair_to_bf16_ptx(packed)
        scale = e8m0_to_bf16(tl.load(scale_ptr + row))
    tl.store(out_ptr + row * 32 + tl.arange(0, 32), tl.interleave(lo * scale, hi * scale))


@pytest.mark.skipif(torch.version.hip is not None, reason="the PTX decode is the CUDA path")
@pytest.mark.parametrize("fold", [False, True], ids=["scale_apart", "scale_folded"])
def test_ptx_decode_is_exact_for_every_byte_and_scale(fold):
    """Every packed byte (both nibbles, each byte position of a 32-bit word) under every E8M0 byte
    0..254 (folded: 0..FOLD_MAX_SCALE_BYTE, one multiply by 2^(byte - 1)) equals dequantize_mxfp4
    rounded to bf16 bit for bit (2^-127 and 2^-128 subnormals, inf past bf16's range included)."""
    n = FOLD_MAX_SCALE_BYTE + 1 if fold else 255
    packed = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(16, 16).repeat(n, 1)  # [n * 16, 16]
    scale = torch.arange(n, dtype=torch.uint8, device=DEVICE).repeat_interleave(16)[:, None]  # [n * 16, 1]
    out = torch.empty(packed.shape[0], 32, dtype=torch.bfloat16, device=DEVICE)
    _decode_probe_kernel[(packed.shape[0],)](packed, scale, out, FOLD=fold)
    expected = dequantize_mxfp4(packed, scale).bfloat16()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@triton.jit
def _fp8_upcast_probe_kernel(codes_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3fn_to_f16_ptx(tl.load(codes_ptr + offs)))


@pytest.mark.skipif(torch.version.hip is not None, reason="the PTX upcast is the CUDA path")
@pytest.mark.parametrize("case", ["random", "extreme scales", "nan block"])
def test_ptx_integer_dot_equals_the_ptx_dequantized_dot_bit_for_bit(case):
    """The W4A4 decode path's prmt/dp4a block dot (e2m1_dot_ptx) against the dequantizing
    decode of the same block on QDQ'd activations, both compiled with their CUDA asm: the same
    fp32 bits (exact products and sums) for 256 rows of random codes, E8M0 0 / 254, NaN."""
    from test_kernels_mxfp4_int_dot import both_partials

    f, i = both_partials(case, DEVICE, ptx=torch.version.hip is None)
    if case == "nan block":
        assert f.isnan().all() and i.isnan().all()
    else:
        assert torch.isfinite(f).all() and torch.equal(f.view(torch.int32), i.view(torch.int32))


def test_ptx_fp8_upcast_is_exact_for_every_byte():
    """Every e4m3fn byte, at each byte position of a 32-bit word, upcasts to torch's fp16 value
    bit for bit (subnormals and -0 included); 0x7F / 0xFF are NaN."""
    every = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    codes = torch.cat([every.roll(k) for k in range(4)]).view(torch.float8_e4m3fn)  # byte b at word position (b + k) % 4
    out = torch.empty(codes.shape, dtype=torch.float16, device=DEVICE)
    _fp8_upcast_probe_kernel[(1,)](codes, out, N=codes.numel())
    expected = codes.to(torch.float16)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan) and nan.sum() == 8
    assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


LINEAR_SHAPES = {"shared_gate_up_tp8": (512, 7168), "shared_down_tp8": (7168, 256), "dense_down_tp8": (7168, 2304)}


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300, 2048])  # 300 / 2048: WIDE_TILES on NVIDIA
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
def test_mxfp4_linear(shape, num_tokens, quantize):
    n, k = LINEAR_SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    packed, scale = random_mxfp4(n, k, g=g)
    x = torch.randn(num_tokens, k, generator=g, device=DEVICE).bfloat16()
    bias = torch.randn(n, generator=g, device=DEVICE).bfloat16()
    out = mxfp4_linear(x, packed, scale, bias, quantize_activations=quantize)
    a = qdq_mxfp4(x) if quantize else x
    assert_rel_close(out, a.float() @ dequantize_mxfp4(packed, scale).T + bias.float())
    assert foldable_scales(scale)  # and the scales folded into the decode: the same bits
    assert torch.equal(mxfp4_linear(x, packed, scale, bias, quantize_activations=quantize, fold_scales=True), out)


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("quantize", [False, True], ids=["w4a16", "w4a4_qdq"])
@pytest.mark.parametrize("num_tokens", [4, 128], ids=["decode_path", "grouped_path"])
def test_fused_moe_mxfp4_graph_replay_with_new_routing(num_tokens, quantize):
    x, w13, s13, w2, s2, weights, ids = moe_inputs("kimi_tp8", num_tokens, seed=5)
    assert (num_tokens <= decode_max_tokens(w2.shape[2] * 2, quantize)) == (num_tokens == 4)
    graph, out = _capture(lambda: fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, quantize))
    for seed in (6, 7):
        x2, _, _, _, _, weights2, ids2 = moe_inputs("kimi_tp8", num_tokens, seed=seed)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        assert_rel_close(out, moe_reference(x, w13, s13, w2, s2, weights, ids, quantize))


# ------------------------------------------------------------------------------------ FP8 KV

LATENT, ROPE = 512, 64


def _device_metadata(q_lens, ctx_lens, block_size, num_blocks, first_block_id=0, seed=0) -> AttentionMetadata:
    meta = make_metadata(q_lens, ctx_lens, block_size, num_blocks, torch.Generator().manual_seed(seed), first_block_id)
    return AttentionMetadata(meta.query_start_loc.to(DEVICE), meta.context_lens.to(DEVICE),
                             meta.block_tables.to(DEVICE), meta.slot_mapping.to(DEVICE),
                             meta.max_query_len, meta.max_context_len)


def test_fp8_mla_write_then_attend_past_4gib():
    """Kimi latent rows in fp8 (576 B/token), 64-token blocks, 140,000 blocks = 5.2 GB: block
    65,536 starts at 2.4 GB, the tables use ids >= 65,536 and >= 116,509 (past 4 GiB);
    decode at 32k and verify rows."""
    block_size, num_blocks, heads = 64, 140_000, 8
    scale = torch.tensor([0.05], device=DEVICE)
    cache = torch.empty(num_blocks, block_size, LATENT + ROPE, device=DEVICE, dtype=torch.float8_e4m3fn)
    cache.view(torch.uint8).random_(0, 0x7E)  # finite positive and negative codes below NaN
    cache.view(torch.uint8)[..., ::2] |= 0x80
    assert cache.numel() > 4 * 2**30
    for first_block, (q_lens, ctx_lens) in [(65_536, ([1, 1, 4], [32768, 999, 8000])), (116_509, ([4, 1], [300, 5000]))]:
        meta = _device_metadata(q_lens, ctx_lens, block_size, num_blocks, first_block_id=first_block)
        tokens = sum(q_lens)
        g = torch.Generator(device=DEVICE).manual_seed(first_block)
        c_kv = torch.randn(tokens, LATENT, generator=g, device=DEVICE).bfloat16()
        k_pe = torch.randn(tokens, ROPE, generator=g, device=DEVICE).bfloat16()
        write_mla_kv_cache(c_kv, k_pe, cache, meta.slot_mapping, scale=scale)
        written = cache.view(torch.uint8).flatten(0, 1)[meta.slot_mapping]
        assert torch.equal(written, quantize_fp8(torch.cat([c_kv, k_pe], -1), scale, cache.dtype).view(torch.uint8))
        q = torch.randn(tokens, heads, LATENT + ROPE, generator=g, device=DEVICE).bfloat16()
        blocks = meta.block_tables.unique().long()
        dense = dequantize_fp8(cache[blocks], scale)  # only the blocks in use, fp32
        remap = torch.full((num_blocks,), -1, dtype=torch.int32, device=DEVICE)
        remap[blocks] = torch.arange(blocks.numel(), dtype=torch.int32, device=DEVICE)
        local = AttentionMetadata(meta.query_start_loc, meta.context_lens, remap[meta.block_tables.long()],
                                  meta.slot_mapping, meta.max_query_len, meta.max_context_len)
        ref = torch_ref.paged_attention(q.float(), dense.unsqueeze(2), dense[..., :LATENT].unsqueeze(2), local, 0.072)
        for splits in (None, 1, 8):
            out = mla_paged_attention(q[..., :LATENT], q[..., LATENT:], cache, *metadata_args(meta), 0.072,
                                      kv_scale=scale, num_kv_splits=splits)
            assert_rel_close(out, ref)
    del cache
    torch.cuda.empty_cache()


def test_fp8_mha_write_then_attend():
    """EAGLE3 draft cache (8 kv heads x 128) in fp8 with separate K and V scales."""
    q_lens, ctx_lens = [1, 1, 4, 1], [32768, 8191, 700, 17]
    num_blocks = sum(-(-c // 16) for c in ctx_lens) + 64
    meta = _device_metadata(q_lens, ctx_lens, 16, num_blocks)
    k_scale, v_scale = torch.tensor([0.02], device=DEVICE), torch.tensor([0.011], device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    k_cache = quantize_fp8(torch.randn(num_blocks, 16, 8, 128, generator=g, device=DEVICE) * 3, k_scale, torch.float8_e4m3fn)
    v_cache = quantize_fp8(torch.randn(num_blocks, 16, 8, 128, generator=g, device=DEVICE) * 3, v_scale, torch.float8_e4m3fn)
    tokens = sum(q_lens)
    key, value = torch.randn(2, tokens, 8, 128, generator=g, device=DEVICE).bfloat16()
    write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    slots = meta.slot_mapping
    assert torch.equal(k_cache.view(torch.uint8).flatten(0, 1)[slots],
                       quantize_fp8(key, k_scale, k_cache.dtype).view(torch.uint8))
    q = torch.randn(tokens, 8, 128, generator=g, device=DEVICE).bfloat16()
    ref = torch_ref.paged_attention(q.float(), dequantize_fp8(k_cache, k_scale), dequantize_fp8(v_cache, v_scale), meta, 0.088)
    for splits in (None, 1, 16):
        out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), 0.088, k_scale=k_scale, v_scale=v_scale,
                              num_kv_splits=splits)
        assert_rel_close(out, ref)


def test_fp8_scale_is_read_at_replay():
    """The scale is a device tensor: a graph captured with one value reads the new value on replay."""
    meta = _device_metadata([1, 1], [4000, 77], 16, 300)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    scale = torch.tensor([1.0], device=DEVICE)
    cache = quantize_fp8(torch.randn(300, 16, LATENT + ROPE, generator=g, device=DEVICE), scale, torch.float8_e4m3fn)
    q = torch.randn(2, 8, LATENT + ROPE, generator=g, device=DEVICE).bfloat16()
    graph, out = _capture(lambda: mla_paged_attention(q[..., :LATENT], q[..., LATENT:], cache,
                                                      *metadata_args(meta), 0.072, kv_scale=scale))
    for value in (1.0, 0.25, 3.0):
        scale.fill_(value)
        graph.replay()
        rows = dequantize_fp8(cache, scale)
        assert_rel_close(out, torch_ref.paged_attention(q.float(), rows.unsqueeze(2), rows[..., :LATENT].unsqueeze(2),
                                                        meta, 0.072))


@pytest.mark.parametrize("num_tokens", [1, 4, 32, 128, 300], ids=["decode_1", "decode_4", "decode_32", "expert_gemv_128",
                                                                 "grouped_300"])
def test_fused_shared_expert_slot_compiled(num_tokens):
    """Kimi TP8 with its shared expert fused as expert 384 (9 slots, the last at weight 1.0, as the
    routing kernel writes them), W4A4, against the dequantize reference and against the routed and
    shared experts run apart."""
    x, w13, s13, w2, s2, weights, ids = moe_inputs("kimi_tp8", num_tokens, seed=9)
    g = torch.Generator(device=DEVICE).manual_seed(10)
    _, _, hidden, inter = MOE_SHAPES["kimi_tp8"]
    w13s, s13s = random_mxfp4(1, 2 * inter, hidden, g=g)  # logical shapes (the packed ones are half as wide)
    w2s, s2s = random_mxfp4(1, hidden, inter, g=g)
    w13, s13, w2, s2 = (torch.cat(p) for p in ((w13, w13s), (s13, s13s), (w2, w2s), (s2, s2s)))
    fused_w = torch.cat([weights, weights.new_ones(num_tokens, 1)], 1)
    fused_ids = torch.cat([ids, ids.new_full((num_tokens, 1), 384)], 1)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, fused_w, fused_ids, True)
    assert_rel_close(out, moe_reference(x, w13, s13, w2, s2, fused_w, fused_ids, True))
    apart = (fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True)
             + fused_moe_mxfp4(x, w13, s13, w2, s2, fused_w[:, 8:].contiguous(), fused_ids[:, 8:].contiguous(), True))
    assert_rel_close(out, apart)


@triton.jit
def _codes_probe_kernel(w_ptr, x_lo_ptr, x_hi_ptr, ptx_ptr, portable_ptr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    w, x_lo, x_hi = tl.load(w_ptr + offs), tl.load(x_lo_ptr + offs), tl.load(x_hi_ptr + offs)
    lo, hi = e2m1_codes_ptx(w)
    tl.store(ptx_ptr + offs, dp4a_pair_ptx(lo, hi, x_lo, x_hi))
    tl.store(portable_ptr + offs, _e2m1_dot(w, x_lo, x_hi))


@pytest.mark.skipif(torch.version.hip is not None, reason="the PTX code lookup is the CUDA path")
def test_ptx_code_lookup_dot_equals_the_portable_integer_dot():
    """e2m1_codes_ptx + dp4a_pair_ptx (the expert-GEMV path's CUDA dot) against the portable
    integer dot, compiled: every code in every nibble, and 2^20 random words and activation codes."""
    g = torch.Generator(device=DEVICE).manual_seed(21)
    n = 1 << 20
    words = torch.randint(-2**31, 2**31, (n,), generator=g, device=DEVICE, dtype=torch.int64).to(torch.int32)
    every = torch.tensor([c * 0x11111111 for c in range(16)], dtype=torch.int64).to(torch.int32)
    words[:16] = every.to(DEVICE)
    x = torch.randint(-12, 13, (n, 8), generator=g, device=DEVICE, dtype=torch.int32).to(torch.int8)
    x_lo, x_hi = x[:, :4].contiguous().view(torch.int32).view(-1), x[:, 4:].contiguous().view(torch.int32).view(-1)
    ptx, portable = torch.empty_like(words), torch.empty_like(words)
    _codes_probe_kernel[(n // 1024,)](words, x_lo, x_hi, ptx, portable, N=1024)
    assert portable.abs().max() > 0
    assert torch.equal(ptx, portable)


@pytest.mark.parametrize("num_tokens", [33, 128, 256])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_expert_gemv_path_compiled(shape, num_tokens):
    """The W4A4 expert-grouped GEMV path (its default launch shape at each T) against the fp32
    reference and the grouped GEMMs forced at the same inputs."""
    num_experts, top_k, hidden, inter = MOE_SHAPES[shape]
    x, w13, s13, w2, s2, weights, ids = moe_inputs(shape, num_tokens, seed=10)
    out = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True, out=torch.full_like(x, float("nan")),
                          config=expert_default_config(num_tokens * top_k, num_experts, inter))
    assert_rel_close(out, moe_reference(x, w13, s13, w2, s2, weights, ids, True))
    grouped = fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, True,
                              config=moe_default_config(num_tokens, top_k, num_experts, hidden, inter, x.device))
    assert_rel_close(out, grouped)
