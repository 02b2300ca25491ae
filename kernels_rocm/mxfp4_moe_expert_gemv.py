"""Expert-grouped GEMV path of the MXFP4 fused MoE with MXFP4 activations (W4A4), for the token
counts between the decode path and the grouped tl.dot GEMMs (`mxfp4_moe.fused_moe_mxfp4`).

Same contract as the other two paths:

    a = qdq_mxfp4(x)
    per (token t, slot k), e = topk_ids[t, k]:
        h = qdq_mxfp4(silu(a[t] @ W13[e][:I]^T) * (a[t] @ W13[e][I:]^T))    fp32, h rounded to x's dtype first
        out[t] += topk_weights[t, k] * (h @ W2[e]^T)

Why a third path: the decode path (`mxfp4_moe_decode`) reads an expert's weights once per (token,
slot) pair that picks it, so from a few dozen tokens on it reads most experts several times
(Kimi TP8 at 64 tokens: 576 pair reads of 294 experts); the grouped GEMMs read each expert once
but dequantize every weight to bf16 for tl.dot and run at ~40% of copy bandwidth on an H100
(docs/benchmarks.md section 6). Here the pairs are grouped by expert (`moe_align_block_size`,
blocks of BLOCK_M pairs) and each program multiplies BLOCK_M pairs' activation codes by its
expert's weight codes, loaded and decoded once: the decode path's exact integer dots, with the
weight decode shared by the block:

- x and h are quantized once each (`quantize_rows`: int8 codes, twice the E2M1 value, paired word
  order, and E8M0 scale bytes), as on the decode path;
- a weight word (8 E2M1 codes) becomes two words of signed int8 codes (`e2m1_codes_ptx` on CUDA:
  prmt table lookups, 11 instructions a word), then every pair of the block takes two dp4a
  (`dp4a_pair_ptx`): 11 + 2 x BLOCK_M instructions per 8 weights, against 14 x BLOCK_M on the
  decode path; the interpreter (CPU tests) runs the same sums in portable integer Triton;
- each 32-element block sum is exact in int32 and is scaled once, (dot x activation scale / 4) x
  weight scale: every product is a power of two times an E2M1 x E2M1 product, so each block's
  fp32 value is the dequantizing reference's, bit for bit; blocks are added in a fixed order;
- kernel 1 (grid: M block x intermediate-row tile) writes silu(gate) * up for the block's pairs;
  kernel 2 (grid: M block x output-row tile) writes each pair's routing weight x h @ W2[e]^T in x's
  dtype; `_slot_sum_kernel` adds a token's slots in fp32 in slot order, skipping ids outside
  [0, E) (the alignment drops them: their rows are never written).

Tiles are the decode path's [KL, G, R] (KL lanes along K, one 16-byte vector of packed weights
each; G row groups; R rows a lane) with a leading BLOCK_M axis on the activations and the
accumulators, kept in each lane's registers. Fewer lanes along K than the decode path (32): the G
row groups of a program then share each activation block through L1, so that its pairs'
activations (BLOCK_M x K bytes from L2) stay small next to its weight rows.
Decisions from shapes only: graph-capturable. NVIDIA only: compiled for gfx942 / gfx950 the portable
dots spill VGPRs (ci/compile_kernels.py), so ROCm keeps the decode path and the grouped GEMMs.
Measured (H100 / H200, docs/benchmarks.md section 6): faster than both other paths from 33-48 tokens
to about 200 (TP8 rank at T = 128 on an H200: 654 us against the grouped GEMMs' 865 and the decode
path's 925); the grouped GEMMs win from ~250 tokens, where blocks of 4 pairs redo the code lookup
and the per-block scaling that a tl.dot tile of 16 rows shares.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._mxfp4 import e8m0_to_fp32, silu_mul
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import INTERPRET, IS_HIP
from kernels_rocm.fused_moe import moe_align_block_size
from kernels_rocm.mxfp4_moe_decode import (
    _check_config, _e2m1_dot, _int_words, _tile, _tile_offsets, _words, quantize_rows,
)


@dataclass(frozen=True)
class ExpertGemvConfig:
    """Launch shape: `block_m` pairs of one expert a program (a power of two, the alignment's
    block), `*_rows` rows in each lane's registers, `*_warps` warps, `*_k_lanes` the most lanes
    along K (the rest go over row groups). None: chosen from the token count (`default_config`)."""

    block_m: int = 4
    gate_up_rows: int = 4
    gate_up_warps: int = 4
    gate_up_k_lanes: int = 32
    down_rows: int = 8
    down_warps: int = 4
    down_k_lanes: int = 32


def default_config(num_pairs: int, num_experts: int, inter: int) -> ExpertGemvConfig:
    """Blocks of 2 pairs while experts get 2 pairs or fewer on average, else 4. Measured (H100 and
    H200, ci/bench_mxfp4_expert_gemv.py --sweep, docs/benchmarks.md section 6): 8 pairs a block
    was slower at every T swept (1.2-1.9x at T = 64-256: the padding's dp4a, 254 registers); 4 rows
    a lane in kernel 1 and 8 in kernel 2 (each activation block loaded serves more weight rows),
    against 2 / 2: 12-16% faster at T = 64-256; 8 rows in kernel 1 and 8 warps were slower. Kernel 2
    keeps 4 rows for blocks of 4 over a short I (<= 256: 8 lanes along K, 16 row groups), where 8
    spill registers on sm_90 (ci/compile_kernels.py)."""
    block_m = 2 if num_pairs <= 2 * num_experts else 4
    return ExpertGemvConfig(block_m=block_m, down_rows=4 if block_m == 4 and inter <= 256 else 8)


@triton.jit
def e2m1_codes_ptx(w):
    """CUDA: the 8 E2M1 codes of w (int32, element i in nibble i) as signed int8 codes, twice
    the E2M1 value: (elements 0..3, elements 4..7), one byte each.

    prmt looks up the byte table {0, 1, 2, 3, 4, 6, 8, 12} (twice the E2M1 magnitudes); a code
    with its sign bit set selects in sign-replicate mode, which gives 0x00 (no table byte has its
    top bit set). So one lookup gives the positive codes' values (0 for the negative ones), a
    second on the codes with their sign bits flipped gives the negative codes' magnitudes v (0
    for the others), negated bytewise as (0x80 - v) ^ 0x80 = 0x100 - v (v <= 12: no borrow
    crosses a byte), and OR-ed into the first."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 lo_tab, hi_tab, flipped, w_hi, t, n;
        mov.b32 lo_tab, 0x03020100;
        mov.b32 hi_tab, 0x0C080604;
        xor.b32 flipped, $2, 0x88888888;
        prmt.b32 t, lo_tab, hi_tab, $2;
        prmt.b32 n, lo_tab, hi_tab, flipped;
        sub.u32 n, 0x80808080, n;
        xor.b32 n, n, 0x80808080;
        or.b32 $0, t, n;
        shr.u32 w_hi, $2, 16;
        shr.u32 flipped, flipped, 16;
        prmt.b32 t, lo_tab, hi_tab, w_hi;
        prmt.b32 n, lo_tab, hi_tab, flipped;
        sub.u32 n, 0x80808080, n;
        xor.b32 n, n, 0x80808080;
        or.b32 $1, t, n;
        }""",
        "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
    )


@triton.jit
def dp4a_pair_ptx(lo, hi, x_lo, x_hi):
    """CUDA: dot of signed int8 codes lo / hi with activations x_lo / x_hi (4 bytes each)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t;
        dp4a.s32.s32 t, $1, $3, 0;
        dp4a.s32.s32 $0, $2, $4, t;
        }""",
        "=r,r,r,r,r", [lo, hi, x_lo, x_hi], dtype=tl.int32, is_pure=True, pack=1,
    )


@triton.jit
def _expert_block(w_ptrs, s_ptrs, x_lo, x_hi, a_scale, valid, PTX_DOT: tl.constexpr):
    """One 32-element block per (lane, row, pair): w_ptrs [KL, G, R, 4] the weight words, s_ptrs
    [KL, G, R] their E8M0 bytes, x_lo / x_hi [KL, G, 1, M, 4] the pairs' activation codes,
    a_scale [KL, G, 1, M] their block scales / 4, valid [KL, 1, 1]. Returns [KL, G, R, M] fp32."""
    words = tl.load(w_ptrs, mask=valid[:, :, :, None], other=0)
    if PTX_DOT:
        lo, hi = e2m1_codes_ptx(words)
        dots = dp4a_pair_ptx(lo[:, :, :, None, :], hi[:, :, :, None, :], x_lo, x_hi)
    else:
        dots = _e2m1_dot(words[:, :, :, None, :], x_lo, x_hi)
    scale = e8m0_to_fp32(tl.load(s_ptrs, mask=valid, other=127))
    return (tl.sum(dots, axis=4).to(tl.float32) * a_scale) * scale[:, :, :, None]


@triton.jit
def _pair_rows(sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's M block: (whether it is in use, its expert, its pair ids [BLOCK_M] int64,
    which of them are real pairs)."""
    block = tl.program_id(0)
    used = block * BLOCK_M < tl.load(num_padded_ptr)
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return used, expert, pairs, pairs < num_pairs


@triton.jit
def _pair_activations(a_ptr, as_ptr, rows, stride_am, stride_asm, stride_ask, lane, words, G: tl.constexpr):
    """Pointers to the pairs' activation words [KL, G, 1, M, 4] (a block's first word, paired
    order) and scale bytes [KL, G, 1, M] (the same for every G). The pair axis comes after the lane
    and row axes: Triton gives lanes and warps to the non-contiguous axes in order, so KL and G get
    them as in the weight tile (no layout conversion in the loop) and M stays in each lane's
    registers. stride_ask (1) is unspecialized for that reason: known contiguous, the scale bytes
    would be vectorized across lanes in a layout of their own."""
    a_words = (a_ptr + rows[None, None, None, :, None] * stride_am
               + (lane[:, :, :, None] * 8 + words)[:, :, :, None, :])
    a_scales = (as_ptr + rows[None, None, None, :] * stride_asm + lane[:, :, :, None] * stride_ask
                + tl.zeros([1, G, 1, 1], tl.int32))
    return a_words, a_scales


@triton.jit
def _load_block(a_words, a_scales, pair_valid, valid):
    """One K step's activation codes (x_lo, x_hi) and scale / 4 for every pair of the block."""
    mask = pair_valid[None, None, None, :, None] & valid[:, :, :, None, None]
    x_lo = tl.load(a_words, mask=mask, other=0)
    x_hi = tl.load(a_words + 4, mask=mask, other=0)
    scale = tl.load(a_scales, mask=pair_valid[None, None, None, :] & valid[:, :, :, None], other=127)
    return x_lo, x_hi, e8m0_to_fp32(scale) * 0.25


@triton.jit
def _expert_tile(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                 KL: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
    """The program's weight-word pointers [KL, G, R, 4] and scale pointers [KL, G, R] in `expert`
    (its row tile, program_id(1)), the rows' validity [G, R], the lane index [KL, 1, 1] and the word
    offsets [1, G, 1, 4]."""
    rows, row_valid, lane, byte, act = _tile_offsets(N, KL, G, R)
    words = _int_words(G)
    w_tile = w_ptr + expert * stride_we + rows[:, :, :, None] * stride_wn + lane[:, :, :, None] * 4 + words
    s_tile = s_ptr + expert * stride_se + rows * stride_sn + lane * stride_sk
    return w_tile, s_tile, row_valid, lane, words


# stride_sk / stride_ask (the weight / activation scales' K strides, 1) are passed unspecialized, as in
# mxfp4_moe_decode: a specialized 1 changes the scale loads' layout and adds a shared-memory conversion
# to every loop step.
@triton.jit(do_not_specialize=["num_pairs", "stride_sk", "stride_ask"])
def _expert_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, N, K, stride_sk, stride_ask,  # N = intermediate size I (gate rows [0, N), up rows [N, 2N)), K = hidden size
    stride_xm: tl.int64, stride_xsm: tl.int64, stride_we: tl.int64, stride_wn: tl.int64,
    stride_se: tl.int64, stride_sn: tl.int64, stride_hm: tl.int64,
    TOP_K: tl.constexpr, PTX_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    KL: tl.constexpr, G: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    used, expert, pairs, pair_valid = _pair_rows(sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if used:  # blocks past the aligned length (a static upper bound) do nothing
        w_gate, s_gate, row_valid, lane, words = _expert_tile(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se,
                                                              stride_sn, stride_sk, KL, G, R)
        w_up = w_gate + N * stride_wn
        s_up = s_gate + N * stride_sn
        x_words, x_scales = _pair_activations(x_ptr, xs_ptr, pairs // TOP_K, stride_xm, stride_xsm, stride_ask, lane,
                                              words, G)
        gate = tl.zeros([KL, G, R, BLOCK_M], dtype=tl.float32)
        up = tl.zeros([KL, G, R, BLOCK_M], dtype=tl.float32)
        num_blocks = K // 32
        for j0 in range(0, num_blocks, KL):
            valid = lane + j0 < num_blocks
            x_lo, x_hi, a_scale = _load_block(x_words + j0 * 8, x_scales + j0, pair_valid, valid)
            gate += _expert_block(w_gate + j0 * 4, s_gate + j0 * stride_sk, x_lo, x_hi, a_scale, valid, PTX_DOT)
            up += _expert_block(w_up + j0 * 4, s_up + j0 * stride_sk, x_lo, x_hi, a_scale, valid, PTX_DOT)
        h = silu_mul(tl.sum(gate, axis=0), tl.sum(up, axis=0), h_ptr.dtype.element_ty)  # [G, R, M]
        out_rows = tl.program_id(1) * (G * R) + tl.arange(0, G)[:, None] * R + tl.arange(0, R)[None, :]
        tl.store(h_ptr + pairs[None, None, :] * stride_hm + out_rows[:, :, None], h,
                 mask=pair_valid[None, None, :] & row_valid[:, :, None])


@triton.jit(do_not_specialize=["num_pairs", "stride_sk", "stride_ask"])
def _expert_down_kernel(
    h_ptr, hs_ptr, w_ptr, s_ptr, part_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, N, K, stride_sk, stride_ask,  # N = hidden size H (output rows), K = intermediate size I
    stride_hm: tl.int64, stride_hsm: tl.int64, stride_we: tl.int64, stride_wn: tl.int64,
    stride_se: tl.int64, stride_sn: tl.int64, stride_pm: tl.int64,
    PTX_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    KL: tl.constexpr, G: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    used, expert, pairs, pair_valid = _pair_rows(sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if used:  # blocks past the aligned length (a static upper bound) do nothing
        w_tile, s_tile, row_valid, lane, words = _expert_tile(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se,
                                                              stride_sn, stride_sk, KL, G, R)
        h_words, h_scales = _pair_activations(h_ptr, hs_ptr, pairs, stride_hm, stride_hsm, stride_ask, lane, words, G)
        acc = tl.zeros([KL, G, R, BLOCK_M], dtype=tl.float32)
        num_blocks = K // 32
        for j0 in range(0, num_blocks, KL):
            valid = lane + j0 < num_blocks
            x_lo, x_hi, a_scale = _load_block(h_words + j0 * 8, h_scales + j0, pair_valid, valid)
            acc += _expert_block(w_tile + j0 * 4, s_tile + j0 * stride_sk, x_lo, x_hi, a_scale, valid, PTX_DOT)
        weight = tl.load(topk_weights_ptr + pairs, mask=pair_valid, other=0.0)
        out = tl.sum(acc, axis=0) * weight[None, None, :]  # [G, R, M]
        out_rows = tl.program_id(1) * (G * R) + tl.arange(0, G)[:, None] * R + tl.arange(0, R)[None, :]
        tl.store(part_ptr + pairs[None, None, :] * stride_pm + out_rows[:, :, None], out.to(part_ptr.dtype.element_ty),
                 mask=pair_valid[None, None, :] & row_valid[:, :, None])


@triton.jit
def _slot_sum_kernel(part_ptr, ids_ptr, out_ptr, N, E, stride_pm: tl.int64, stride_om: tl.int64,
                     TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over slots k in order of part[t * TOP_K + k] in fp32, ids outside [0, E)
    skipped (their rows were never written)."""
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + token * TOP_K + k)
        known = (e >= 0) & (e < E)
        acc += tl.load(part_ptr + (token * TOP_K + k) * stride_pm + cols, mask=(cols < N) & known,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def fused_moe_mxfp4_expert_gemv(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, config: ExpertGemvConfig | None = None,
) -> torch.Tensor:
    """The W4A4 expert-grouped path on inputs `mxfp4_moe.fused_moe_mxfp4` has checked; writes out."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_pairs, num_experts, inter)
    _check_config(cfg, ("block_m", "gate_up_rows", "down_rows", "gate_up_k_lanes", "down_k_lanes"))
    ptx = not IS_HIP and not INTERPRET
    launch = pdl.launch_args(x.device)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    blocks = expert_ids.shape[0]
    (x_codes, x_scales), w13_words, w2_words = quantize_rows(x), _words(w13, "w13"), _words(w2, "w2")
    x_codes = x_codes.view(torch.int32)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    kl, g, r = _tile(hidden, cfg.gate_up_rows, cfg.gate_up_warps, cfg.gate_up_k_lanes)
    _expert_gate_up_kernel[(blocks, triton.cdiv(inter, g * r))](
        x_codes, x_scales, w13_words, w13_scale, h, sorted_ids, expert_ids, num_padded,
        num_pairs, inter, hidden, w13_scale.stride(2), x_scales.stride(1),
        x_codes.stride(0), x_scales.stride(0), w13_words.stride(0), w13_words.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), h.stride(0),
        TOP_K=top_k, PTX_DOT=ptx, BLOCK_M=cfg.block_m, KL=kl, G=g, R=r, num_warps=cfg.gate_up_warps, **launch,
    )
    h_codes, h_scales = quantize_rows(h)
    h_codes = h_codes.view(torch.int32)
    partial = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    kl, g, r = _tile(inter, cfg.down_rows, cfg.down_warps, cfg.down_k_lanes)
    _expert_down_kernel[(blocks, triton.cdiv(hidden, g * r))](
        h_codes, h_scales, w2_words, w2_scale, partial, topk_weights, sorted_ids, expert_ids, num_padded,
        num_pairs, hidden, inter, w2_scale.stride(2), h_scales.stride(1),
        h_codes.stride(0), h_scales.stride(0), w2_words.stride(0), w2_words.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), partial.stride(0),
        PTX_DOT=ptx, BLOCK_M=cfg.block_m, KL=kl, G=g, R=r, num_warps=cfg.down_warps, **launch,
    )
    return sum_slots(partial, topk_ids, num_experts, out)


def sum_slots(partial: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = each token's weighted per-slot rows partial [T * top_k, H] summed in slot order
    in fp32 (`_slot_sum_kernel`: deterministic, no atomics), slots of ids outside [0, E) skipped."""
    num_tokens, top_k = topk_ids.shape
    hidden = partial.shape[1]
    block = min(1024, triton.next_power_of_2(hidden))
    _slot_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        partial, topk_ids, out, hidden, num_experts, partial.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK=block, num_warps=4, **pdl.launch_args(out.device),
    )
    return out
