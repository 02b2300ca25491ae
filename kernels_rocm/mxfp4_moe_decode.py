"""Decode path of the MXFP4 fused MoE (`mxfp4_moe.fused_moe_mxfp4` at a few tokens): GEMV-style
kernels, no routing alignment, no tl.dot. Same contract as the grouped-GEMM path:

    a = qdq_mxfp4(x) if quantize_activations else x
    per (token t, slot k), e = topk_ids[t, k]:
        h = silu(a[t] @ W13[e][:I]^T) * (a[t] @ W13[e][I:]^T)      fp32, rounded to x's dtype
        h = qdq_mxfp4(h) if quantize_activations
        out[t] += topk_weights[t, k] * (h @ W2[e]^T)

At T = 1..8 tokens x top-8 each (token, slot) pair touches one expert and every weight byte is
used once (twice at most where two tokens share an expert): the MoE is a weight read. The
grouped GEMM pads each pair to a 16-row tl.dot tile and needs the routing alignment, a split-K
sum and a top-k sum around its two GEMMs (five launches; docs/benchmarks.md section 6). Here:

1. `_gate_up_kernel`, grid (pair, tile of intermediate rows): the program reads its expert from
   topk_ids, walks H with every lane loading one 16-byte vector of packed bytes (32 E2M1 codes,
   exactly one E8M0 block) of each of its gate and up rows per step, plus that block's scale
   byte and the matching 32 activations; it dequantizes in registers (`_mxfp4`), sums the 32
   products per row in fp32, scales the sum once per block and keeps per-lane partial sums; one
   cross-lane reduction at the end, then silu(gate) * up written as h [T*K, I] in x's dtype.
2. `_down_kernel`, grid (token, tile of output rows): the same inner step over I for each of
   the token's K slots, each slot's sum times its routing weight added to one fp32 accumulator:
   the top-k sum needs no extra launch and no atomics; out written once (the grouped path
   rounds each slot's partial to x's dtype before its sum: here only the total is). The slot
   loop and each slot's steps along I (one at Kimi's shapes) are unrolled on NVIDIA, one basic
   block (until 2026-11-27 each slot kept a loop of its own, so that a slot's loads were issued
   only after the slot before had been summed: one memory latency a slot); not on ROCm, where
   the unrolled W4A4 kernel spills VGPRs on gfx942/gfx950 (ci/compile_kernels.py). With W4A4 on
   NVIDIA, `down_ahead` issues each slot's loads that many slots before its dots (`_int_slots`).

Tiles are [KL, G, R, 16]: KL lanes along K (one 16-byte vector each), G row groups over the
remaining lanes (the down GEMM's rows are short: I/2 = 128 bytes at Kimi TP8, 8 vectors), R rows
in each lane's registers sharing its activation block. Only the byte axis is contiguous, so
Triton gives it to one lane and spreads KL, then G, over lanes and warps (order [3, 0, 1, 2]),
and the activation tile [KL, G, 4, 8] (32 values a lane, in 16-byte pieces) gets the same
distribution: nothing crosses lanes in the loops.
With MXFP4 activations (W4A4, Kimi-K2.5 as released) x and h are quantized once each by
`quantize_rows` (a launch each: int8 codes, twice the E2M1 value, and E8M0 scale bytes) and the
kernels multiply codes by codes: every 32-element block is an exact integer dot product
(`_int_block_partial`; on CUDA `_mxfp4.e2m1_dot_ptx`: prmt table lookups and dp4a, 14
instructions for 8 weights), scaled once by both blocks' scales. E2M1 products times powers of
two and their block sums are exact in fp32, so this is, bit for bit, what dequantizing the
weights against QDQ'd activations computes (CPU test), at 355 instructions a lane per 128
gate/up weights in the sm_90 loop against 845 with the dequantizing decode (docs/benchmarks.md
section 6). Earlier designs: QDQ inside every program (53.1 µs against the grouped path's 51.1
at T = 1 on Kimi TP8), then a QDQ launch and the W4A16 kernels (31.8 µs).
Fixed summation order: deterministic. Decisions from shapes only: graph-capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_rocm._mxfp4 import (
    MX_BLOCK,
    e2m1_dot_ptx,
    e2m1_pair_to_bf16_ptx,
    e2m1_pair_to_fp32,
    e2m1_to_int,
    e8m0_to_fp32,
    quantize_mxfp4_blocks,
    silu_mul,
)
from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import INTERPRET, IS_HIP, num_compute_units


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the two decode kernels: `*_rows` rows in each lane's registers (a power of
    two; gate_up_rows counts intermediate rows, each a gate and an up row), `*_warps` warps a
    program, `*_k_lanes` the most lanes along K (the rest over row groups; None: up to the row's
    16-byte vectors), `down_ahead` (W4A4 on NVIDIA) how many of a token's slots kernel 2 loads
    ahead of its dots (0: each slot's loads where its dots are, scheduled by the compiler).

    The defaults are ROCm's and W4A16's shape, reasoned, then swept (ci/bench_mxfp4_decode.py
    --sweep; H200, 2026-11-23): two rows a lane and 4 warps give kernel 1 1,024 programs at T = 1 on
    Kimi TP8 (8 pairs x 128 row tiles), each lane walking H = 7168 in two steps; kernel 2 gets 224
    programs of 32 rows at T = 1. W4A4 on NVIDIA takes `default_config`'s shape by token count."""

    gate_up_rows: int = 2
    gate_up_warps: int = 4
    down_rows: int = 2
    down_warps: int = 4
    gate_up_k_lanes: int | None = None
    down_k_lanes: int | None = None
    down_ahead: int = 0


@triton.jit
def _block_partial(w_ptrs, s_ptrs, a_even, a_odd, valid, PTX_DECODE: tl.constexpr):
    """Sum over one 32-element block per (lane, row) of W (dequantized) times a, in fp32.

    w_ptrs [KL, G, R, 16] packed bytes, s_ptrs [KL, G, R] E8M0 bytes, a_even / a_odd
    [KL, G, 1, 16] the block's even / odd activations (fp32), valid [KL, 1, 1] the lane's block
    exists. The 32 products are summed unscaled and the sum multiplied by the block's scale once
    (a power of two: exact up to the sum's own rounding)."""
    packed = tl.load(w_ptrs, mask=valid[:, :, :, None], other=0)
    scale = e8m0_to_fp32(tl.load(s_ptrs, mask=valid, other=127))
    if PTX_DECODE:
        lo, hi = e2m1_pair_to_bf16_ptx(packed)
        lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    else:
        lo, hi = e2m1_pair_to_fp32(packed)
    # two sums, each a chain of FMAs in the lane (one sum of lo * a + hi * b costs an extra add a weight)
    return (tl.sum(lo * a_even, axis=3) + tl.sum(hi * a_odd, axis=3)) * scale


@triton.jit
def _activation_block(ptrs, valid, KL: tl.constexpr, G: tl.constexpr):
    """Load each lane's 32-element activation block (ptrs [KL, G, 4, 8]), split into even / odd
    [KL, G, 1, 16] fp32."""
    a = tl.load(ptrs, mask=valid[:, :, :, None], other=0.0)
    a_even, a_odd = tl.split(tl.reshape(a.to(tl.float32), [KL, G, 16, 2]))
    return a_even[:, :, None, :], a_odd[:, :, None, :]


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, stride_x: tl.int64, stride_codes: tl.int64,
                          stride_scales: tl.int64, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """codes[row], scales[row] = the MXFP4 quantization of x[row] per 32 consecutive values
    (quantize_mxfp4_blocks; a width that is a multiple of 32: the masked tail holds whole
    blocks), the codes of each block in paired word order (`quantize_rows`)."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    codes, scales = quantize_mxfp4_blocks(x, 1, BLOCK)
    word = (cols % 32) // 4
    paired = cols - cols % 32 + (word // 2 + 4 * (word % 2)) * 4 + cols % 4
    blocks = (tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32))[None, :]
    tl.store(codes_ptr + row * stride_codes + paired, codes, mask=mask)
    tl.store(scales_ptr + row * stride_scales + blocks, scales.to(tl.uint8), mask=blocks * 32 < width)


@triton.jit
def _e2m1_dot(w, x_lo, x_hi):
    """e2m1_dot_ptx in portable Triton (ROCm, the interpreter): the same exact int32 sums."""
    dot = tl.zeros(w.shape, tl.int32)
    for i in tl.static_range(4):
        dot += e2m1_to_int((w >> (4 * i)) & 15) * ((x_lo << (24 - 8 * i)) >> 24)
        dot += e2m1_to_int((w >> (16 + 4 * i)) & 15) * ((x_hi << (24 - 8 * i)) >> 24)
    return dot


@triton.jit
def _int_block_partial(w_ptrs, s_ptrs, x_lo, x_hi, a_scale, valid, PTX_DOT: tl.constexpr):
    """`_block_partial` for MXFP4 activations (W4A4): one 32-element block per (lane, row) as an
    exact integer dot product of the codes, scaled once.

    w_ptrs [KL, G, R, 4] the block's packed bytes as int32 words (8 codes each), s_ptrs [KL, G, R]
    E8M0 bytes, x_lo / x_hi [KL, G, 1, 4] the activation codes (twice the E2M1 value, int8) for
    each weight word's elements 0..3 / 4..7, a_scale [KL, 1, 1] the activation block's scale / 4.
    Every product of two E2M1 values times a power of two is exact in fp32, and so is their sum
    over a block: (dot * a_scale) * w_scale is the fp32 value the dequantized path sums, bit for
    bit."""
    dots = _int_dots(tl.load(w_ptrs, mask=valid[:, :, :, None], other=0), x_lo, x_hi, PTX_DOT)
    scale = e8m0_to_fp32(tl.load(s_ptrs, mask=valid, other=127))  # after the dots: fewer registers in kernel 1
    return (dots.to(tl.float32) * a_scale) * scale


@triton.jit
def _int_dots(words, x_lo, x_hi, PTX_DOT: tl.constexpr):
    """Each (lane, row)'s exact int32 block dot [KL, G, R] of weight words [KL, G, R, 4] (see
    `_int_block_partial`)."""
    if PTX_DOT:
        dots = e2m1_dot_ptx(words, x_lo, x_hi)
    else:
        dots = _e2m1_dot(words, x_lo, x_hi)
    return tl.sum(dots, axis=3)


@triton.jit
def _int_activation_block(codes_ptrs, scale_ptrs, valid):
    """A lane's activation block for `_int_block_partial`: codes_ptrs [KL, G, 1, 4] at the
    block's first word (paired order: words 0, 2, 4, 6 then 1, 3, 5, 7), scale_ptrs [KL, 1, 1]."""
    x_lo = tl.load(codes_ptrs, mask=valid[:, :, :, None], other=0)
    x_hi = tl.load(codes_ptrs + 4, mask=valid[:, :, :, None], other=0)
    return x_lo, x_hi, e8m0_to_fp32(tl.load(scale_ptrs, mask=valid, other=127)) * 0.25


@triton.jit
def _tile_offsets(N, KL: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
    """Rows of this program's tile [1, G, R] (clamped to N - 1: rows past N re-read the last row,
    no mask on the loads), their validity, the lane's vector index [KL, 1, 1], and the byte /
    activation offsets inside a block ([1, 1, 1, 16] and [1, G, 4, 8], the latter 0 along G)."""
    rows = tl.program_id(1) * (G * R) + tl.arange(0, G)[:, None] * R + tl.arange(0, R)[None, :]
    lane = tl.arange(0, KL)[:, None, None]
    byte = tl.arange(0, 16)[None, None, None, :]
    act = (tl.arange(0, 4)[:, None] * 8 + tl.arange(0, 8)[None, :])[None, None, :, :] + tl.zeros([1, G, 1, 1], tl.int32)
    return tl.minimum(rows, N - 1).to(tl.int64)[None, :, :], rows < N, lane, byte, act


# stride_sk is the scales' K stride (1), passed unspecialized: were it known to be 1, Triton would
# vectorize the scale loads across neighbouring lanes, giving them a layout unlike the weights'
# and a shared-memory layout conversion in every loop step (seen in the sm_90 SASS).
# A_INT (W4A4): x / h are MXFP4 codes as int32 words with their scale bytes (`quantize_rows`), the
# weights int32 words (strides in words), and each block is an integer dot (`_int_block_partial`).
@triton.jit(do_not_specialize=["stride_sk"])
def _gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, ids_ptr,
    N, K, E, stride_sk,  # N = intermediate size I (gate rows [0, N), up rows [N, 2N)), K = hidden size H, E experts
    stride_xm: tl.int64, stride_xsm: tl.int64, stride_we: tl.int64, stride_wn: tl.int64,
    stride_se: tl.int64, stride_sn: tl.int64, stride_hm: tl.int64,
    TOP_K: tl.constexpr, PTX_DECODE: tl.constexpr, A_INT: tl.constexpr,
    KL: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    expert = tl.where((expert >= 0) & (expert < E), expert, 0)  # in bounds; _down_kernel drops the pair
    rows, row_valid, lane, byte, act = _tile_offsets(N, KL, G, R)
    s_gate = s_ptr + expert * stride_se + rows * stride_sn + lane * stride_sk
    s_up = s_gate + N * stride_sn
    gate = tl.zeros([KL, G, R], dtype=tl.float32)
    up = tl.zeros([KL, G, R], dtype=tl.float32)
    num_blocks = K // 32
    if A_INT:
        words = _int_words(G)
        w_gate = w_ptr + expert * stride_we + rows[:, :, :, None] * stride_wn + lane[:, :, :, None] * 4 + words
        w_up = w_gate + N * stride_wn
        x_words = x_ptr + (pair // TOP_K) * stride_xm + lane[:, :, :, None] * 8 + words
        x_scales = xs_ptr + (pair // TOP_K) * stride_xsm + lane
        for j0 in range(0, num_blocks, KL):
            valid = lane + j0 < num_blocks
            x_lo, x_hi, a_scale = _int_activation_block(x_words + j0 * 8, x_scales + j0, valid)
            gate += _int_block_partial(w_gate + j0 * 4, s_gate + j0 * stride_sk, x_lo, x_hi, a_scale, valid,
                                       PTX_DECODE)
            up += _int_block_partial(w_up + j0 * 4, s_up + j0 * stride_sk, x_lo, x_hi, a_scale, valid, PTX_DECODE)
    else:
        w_gate = w_ptr + expert * stride_we + rows[:, :, :, None] * stride_wn + lane[:, :, :, None] * 16 + byte
        w_up = w_gate + N * stride_wn
        a_ptrs = x_ptr + (pair // TOP_K) * stride_xm + lane[:, :, :, None] * 32 + act
        for j0 in range(0, num_blocks, KL):
            valid = lane + j0 < num_blocks
            a_even, a_odd = _activation_block(a_ptrs + j0 * 32, valid, KL, G)
            gate += _block_partial(w_gate + j0 * 16, s_gate + j0 * stride_sk, a_even, a_odd, valid, PTX_DECODE)
            up += _block_partial(w_up + j0 * 16, s_up + j0 * stride_sk, a_even, a_odd, valid, PTX_DECODE)
    h = silu_mul(tl.sum(gate, axis=0), tl.sum(up, axis=0), h_ptr.dtype.element_ty)  # [G, R]
    out_rows = tl.program_id(1) * (G * R) + tl.arange(0, G)[:, None] * R + tl.arange(0, R)[None, :]
    tl.store(h_ptr + pair * stride_hm + out_rows, h, mask=row_valid)


@triton.jit
def _int_words(G: tl.constexpr):
    """Word offsets 0..3 of a lane's 16 bytes, [1, G, 1, 4] (G-shaped: the same distribution over
    lanes as the weight tile, see _tile_offsets)."""
    return tl.arange(0, 4)[None, None, None, :] + tl.zeros([1, G, 1, 1], tl.int32)


@triton.jit
def _slot_partial(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, pair, E, K, stride_sk,
                  stride_hm, stride_hsm, stride_we, stride_se, w_tile, s_tile, lane, act,
                  PTX_DECODE: tl.constexpr, A_INT: tl.constexpr, K_STEPS: tl.constexpr, KL: tl.constexpr,
                  G: tl.constexpr, R: tl.constexpr):
    """One (token, slot) pair's routing weight times its per-lane partial sums [KL, G, R] (w_tile
    in words with A_INT, act then `_int_words`). The K_STEPS steps along K are unrolled: the code of
    all slots is one basic block, so the compiler can issue every slot's loads before the first
    slot's dots (with a loop per slot each slot's loads waited for the slot before)."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    known = (expert >= 0) & (expert < E)  # as in the grouped path, an id out of range adds nothing
    expert = tl.where(known, expert, 0)
    part = tl.zeros([KL, G, R], dtype=tl.float32)
    num_blocks = K // 32
    if A_INT:
        h_words = h_ptr + pair * stride_hm + lane[:, :, :, None] * 8 + act
        h_scales = hs_ptr + pair * stride_hsm + lane
        for step in tl.static_range(K_STEPS):
            j0 = step * KL
            valid = (lane + j0 < num_blocks) & known
            x_lo, x_hi, a_scale = _int_activation_block(h_words + j0 * 8, h_scales + j0, valid)
            part += _int_block_partial(w_ptr + expert * stride_we + w_tile + j0 * 4,
                                       s_ptr + expert * stride_se + s_tile + j0 * stride_sk, x_lo, x_hi, a_scale,
                                       valid, PTX_DECODE)
    else:
        a_ptrs = h_ptr + pair * stride_hm + lane[:, :, :, None] * 32 + act
        for step in tl.static_range(K_STEPS):
            j0 = step * KL
            valid = (lane + j0 < num_blocks) & known
            a_even, a_odd = _activation_block(a_ptrs + j0 * 32, valid, KL, G)
            part += _block_partial(w_ptr + expert * stride_we + w_tile + j0 * 16,
                                   s_ptr + expert * stride_se + s_tile + j0 * stride_sk, a_even, a_odd, valid,
                                   PTX_DECODE)
    return part * tl.load(topk_weights_ptr + pair)


@triton.jit
def _int_unit_load(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, pair, j0, E, num_blocks, stride_sk,
                   stride_hm, stride_hsm, stride_we, stride_se, w_tile, s_tile, lane, words):
    """What kernel 2 reads for one (pair, K step) with MXFP4 activations: (weight words, scale bytes,
    activation codes x_lo / x_hi and scale / 4, routing weight); an id out of range reads nothing."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    known = (expert >= 0) & (expert < E)
    expert = tl.where(known, expert, 0)
    valid = (lane + j0 < num_blocks) & known
    x_lo, x_hi, a_scale = _int_activation_block(h_ptr + pair * stride_hm + lane[:, :, :, None] * 8 + words + j0 * 8,
                                                hs_ptr + pair * stride_hsm + lane + j0, valid)
    w = tl.load(w_ptr + expert * stride_we + w_tile + j0 * 4, mask=valid[:, :, :, None], other=0)
    s = tl.load(s_ptr + expert * stride_se + s_tile + j0 * stride_sk, mask=valid, other=127)
    return w, s, x_lo, x_hi, a_scale, tl.load(topk_weights_ptr + pair)


@triton.jit
def _int_slots(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, token, E, K, stride_sk, stride_hm, stride_hsm,
               stride_we, stride_se, w_tile, s_tile, lane, words, PTX_DOT: tl.constexpr, TOP_K: tl.constexpr,
               K_STEPS: tl.constexpr, AHEAD: tl.constexpr, KL: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
    """Kernel 2's sum over a token's slots with MXFP4 activations (CUDA): what `_slot_partial` adds up,
    in the same order, with the loads of each (slot, K step) unit issued AHEAD units before its dots
    (1 <= AHEAD <= TOP_K * K_STEPS), so that several slots' weights are in flight at once."""
    num_blocks = K // 32
    UNITS: tl.constexpr = TOP_K * K_STEPS
    loaded = ()
    for u in tl.static_range(AHEAD):
        loaded = loaded + (_int_unit_load(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr,
                                          token * TOP_K + u // K_STEPS, (u % K_STEPS) * KL, E, num_blocks, stride_sk,
                                          stride_hm, stride_hsm, stride_we, stride_se, w_tile, s_tile, lane, words),)
    acc = tl.zeros([KL, G, R], dtype=tl.float32)
    part = tl.zeros([KL, G, R], dtype=tl.float32)
    for u in tl.static_range(UNITS):
        if u + AHEAD < UNITS:
            loaded = loaded + (_int_unit_load(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr,
                                              token * TOP_K + (u + AHEAD) // K_STEPS, ((u + AHEAD) % K_STEPS) * KL, E,
                                              num_blocks, stride_sk, stride_hm, stride_hsm, stride_we, stride_se,
                                              w_tile, s_tile, lane, words),)
        w, s, x_lo, x_hi, a_scale, weight = loaded[u]
        part += (_int_dots(w, x_lo, x_hi, PTX_DOT).to(tl.float32) * a_scale) * e8m0_to_fp32(s)
        if u % K_STEPS == K_STEPS - 1:
            acc += part * weight
            part = tl.zeros([KL, G, R], dtype=tl.float32)
    return acc


@triton.jit(do_not_specialize=["stride_sk"])
def _down_kernel(
    h_ptr, hs_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, topk_weights_ptr,
    N, K, E, stride_sk,  # N = hidden size H (output rows), K = intermediate size I, E experts
    stride_hm: tl.int64, stride_hsm: tl.int64, stride_we: tl.int64, stride_wn: tl.int64,
    stride_se: tl.int64, stride_sn: tl.int64, stride_om: tl.int64,
    TOP_K: tl.constexpr, PTX_DECODE: tl.constexpr, A_INT: tl.constexpr, UNROLL_SLOTS: tl.constexpr,
    K_STEPS: tl.constexpr, AHEAD: tl.constexpr, KL: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    rows, row_valid, lane, byte, act = _tile_offsets(N, KL, G, R)
    if A_INT:
        act = _int_words(G)
        w_tile = rows[:, :, :, None] * stride_wn + lane[:, :, :, None] * 4 + act
    else:
        w_tile = rows[:, :, :, None] * stride_wn + lane[:, :, :, None] * 16 + byte
    s_tile = rows * stride_sn + lane * stride_sk
    acc = tl.zeros([KL, G, R], dtype=tl.float32)
    if AHEAD:  # W4A4 on CUDA
        acc = _int_slots(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, token, E, K, stride_sk, stride_hm,
                         stride_hsm, stride_we, stride_se, w_tile, s_tile, lane, act, PTX_DECODE, TOP_K, K_STEPS, AHEAD,
                         KL, G, R)
    elif UNROLL_SLOTS:  # the K slots' code in one basic block (a short I is one step a slot)
        for slot in tl.static_range(TOP_K):
            acc += _slot_partial(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, token * TOP_K + slot, E, K,
                                 stride_sk, stride_hm, stride_hsm, stride_we, stride_se, w_tile, s_tile, lane, act,
                                 PTX_DECODE, A_INT, K_STEPS, KL, G, R)
    else:
        for slot in range(TOP_K):
            acc += _slot_partial(h_ptr, hs_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, token * TOP_K + slot, E, K,
                                 stride_sk, stride_hm, stride_hsm, stride_we, stride_se, w_tile, s_tile, lane, act,
                                 PTX_DECODE, A_INT, K_STEPS, KL, G, R)
    out_rows = tl.program_id(1) * (G * R) + tl.arange(0, G)[:, None] * R + tl.arange(0, R)[None, :]
    tl.store(out_ptr + token * stride_om + out_rows, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=row_valid)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 quantization of each row of x [M, W] (W a multiple of 32), Quark's even scale, in
    one launch: (codes int8 [M, W], twice each E2M1 value; scales uint8 [M, W / 32]). The codes of
    a 32-block are stored in paired word order, words (4 codes each) 0, 2, 4, 6, 1, 3, 5, 7, so
    that the decode kernels read a weight word's 8 activations as word i of each half."""
    rows, width = x.shape
    codes = torch.empty(rows, width, dtype=torch.int8, device=x.device)
    scales = torch.empty(rows, width // MX_BLOCK, dtype=torch.uint8, device=x.device)
    if rows and width:
        block = min(1024, triton.next_power_of_2(width))
        _quantize_rows_kernel[(rows, triton.cdiv(width, block))](
            x, codes, scales, x.stride(0), codes.stride(0), scales.stride(0), width, BLOCK=block, num_warps=4,
            **pdl.launch_args(x.device))
    return codes, scales


def default_config(num_tokens: int, top_k: int, hidden: int, inter: int, quantize_activations: bool,
                   device: torch.device) -> DecodeConfig:
    """The launch shape `fused_moe_mxfp4_decode` takes without a config. W4A4 on NVIDIA, by how many
    programs each tile gives (ci/profile_mxfp4_decode.py, H100, docs/benchmarks.md section 6):
    - kernel 1: 4 rows a lane over 32 lanes along K (16 rows a program, 105 registers, 7 full K steps
      over H = 7168) once that gives 3 programs an SM (Kimi: a TP8 rank from T = 4, full width from
      T = 1); else 4 rows on 2 warps of 64 lanes once that gives 6 (a TP8 rank at T = 2); else the
      2 rows a lane of DecodeConfig() (a TP8 rank at T = 1: 1,024 programs);
    - kernel 2: 4 rows a lane once that gives 2 programs an SM; below (a TP8 rank at T <= 2: 112 or
      224 programs of 64 rows), 2 rows a lane with each slot's loads issued 4 slots ahead (TP8 T = 1:
      23.8 against 27.6 us, T = 2: 34.9 against 37.8; from T = 4 loading ahead measured within 2%).
    Elsewhere (W4A16, ROCm: not measured there) DecodeConfig()."""
    if not quantize_activations or IS_HIP:
        return DecodeConfig()
    sms = num_compute_units(device)
    rows = num_tokens * top_k * inter  # intermediate rows over all pairs
    if rows >= 16 * 3 * sms:
        gate_up = dict(gate_up_rows=4, gate_up_k_lanes=32)
    elif rows >= 4 * 6 * sms:
        gate_up = dict(gate_up_rows=4, gate_up_warps=2)
    else:
        gate_up = {}
    _, groups, _ = _tile(inter, 4, DecodeConfig.down_warps)  # kernel 2 at 4 rows: groups x 4 rows a program
    if num_tokens * hidden >= 2 * sms * groups * 4:
        return DecodeConfig(**gate_up, down_rows=4)
    return DecodeConfig(**gate_up, down_rows=2, down_ahead=4)


def _tile(k: int, rows: int, warps: int, k_lanes: int | None = None) -> tuple[int, int, int]:
    """(KL, G, R): lanes along K up to the row's 16-byte vectors (a power of two) and `k_lanes`, the
    rest of the program's lanes over row groups."""
    lanes = (64 if IS_HIP else 32) * warps  # one lane per (KL, G) entry (CDNA: wave64)
    kl = min(lanes, k_lanes or lanes, triton.next_power_of_2(k // MX_BLOCK))
    return kl, lanes // kl, rows


def _check_config(cfg, powers_of_two: tuple[str, ...] = ("gate_up_rows", "down_rows", "gate_up_k_lanes",
                                                         "down_k_lanes")) -> None:
    """ValueError naming the field unless `powers_of_two` are powers of two and the warps 1-8."""
    name_of = type(cfg).__name__
    for name in powers_of_two:
        value = getattr(cfg, name)
        if value is not None and (value < 1 or value & (value - 1)):  # None: unlimited k_lanes
            raise ValueError(f"{name_of}.{name} must be a power of two, got {value}")
    for name in ("gate_up_warps", "down_warps"):
        if getattr(cfg, name) not in (1, 2, 4, 8):
            raise ValueError(f"{name_of}.{name} must be one of 1, 2, 4, 8, got {getattr(cfg, name)}")


def fused_moe_mxfp4_decode(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, quantize_activations: bool, out: torch.Tensor,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """The decode path on inputs `mxfp4_moe.fused_moe_mxfp4` has checked (same arguments); writes out."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    cfg = config or default_config(num_tokens, top_k, hidden, inter, quantize_activations, x.device)
    _check_config(cfg)
    ptx = not IS_HIP and not INTERPRET  # the CUDA weight decode / integer dot in PTX
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    if quantize_activations:  # W4A4: integer dots of the codes, the weights read as int32 words
        (x, x_scales), w13, w2 = quantize_rows(x), _words(w13, "w13"), _words(w2, "w2")
        x = x.view(torch.int32)
    else:
        x_scales = x  # unused
    kl, g, r = _tile(hidden, cfg.gate_up_rows, cfg.gate_up_warps, cfg.gate_up_k_lanes)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, g * r))](
        x, x_scales, w13, w13_scale, h, topk_ids, inter, hidden, w13.shape[0], w13_scale.stride(2),
        x.stride(0), x_scales.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        h.stride(0), TOP_K=top_k, PTX_DECODE=ptx, A_INT=quantize_activations, KL=kl, G=g, R=r,
        num_warps=cfg.gate_up_warps, **pdl.launch_args(x.device),
    )
    h_in, h_scales = h, h
    if quantize_activations:
        h_in, h_scales = quantize_rows(h)
        h_in = h_in.view(torch.int32)
    kl, g, r = _tile(inter, cfg.down_rows, cfg.down_warps, cfg.down_k_lanes)
    k_steps = triton.cdiv(inter // MX_BLOCK, kl)
    _down_kernel[(num_tokens, triton.cdiv(hidden, g * r))](
        h_in, h_scales, w2, w2_scale, out, topk_ids, topk_weights, hidden, inter, w2.shape[0], w2_scale.stride(2),
        h_in.stride(0), h_scales.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        out.stride(0), TOP_K=top_k, PTX_DECODE=ptx, A_INT=quantize_activations, UNROLL_SLOTS=not IS_HIP,
        K_STEPS=k_steps, AHEAD=min(cfg.down_ahead, top_k * k_steps) if quantize_activations and not IS_HIP else 0,
        KL=kl, G=g, R=r, num_warps=cfg.down_warps, **pdl.launch_args(x.device),
    )
    return out


def _words(w: torch.Tensor, name: str) -> torch.Tensor:
    """Packed MXFP4 bytes [E, N, K/2] as int32 words [E, N, K/8] (8 codes a word, same memory)."""
    if w.stride(-1) != 1 or any(st % 4 for st in w.stride()[:-1]) or w.data_ptr() % 16:
        raise ValueError(f"{name}: the W4A4 decode path reads packed weights as 16-byte aligned int32 words; "
                         f"got strides {w.stride()} at offset {w.data_ptr() % 16} mod 16")
    return w.view(torch.int32)
