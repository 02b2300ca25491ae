"""Tensor-core path of the MXFP4 fused MoE with MXFP4 activations (W4A4, NVIDIA): exact integer
block dots on the int8 tensor cores (`mxfp4_moe.fused_moe_mxfp4` with an `IntMmaConfig`).

Same contract as the other paths:

    a = qdq_mxfp4(x)
    per (token t, slot k), e = topk_ids[t, k]:
        h = qdq_mxfp4(silu(a[t] @ W13[e][:I]^T) * (a[t] @ W13[e][I:]^T))    fp32, h rounded to x's dtype first
        out[t] += topk_weights[t, k] * (h @ W2[e]^T)

Why: the expert-grouped GEMVs (`mxfp4_moe_expert_gemv`) spend two dp4a and the block scaling per
pair on CUDA cores, and the grouped GEMMs (`mxfp4_moe`) dequantize every weight to bf16 for tl.dot:
both are instruction-bound above ~32 tokens (docs/benchmarks.md section 6). Here a 32-element
block of one weight row against one pair's activations is an int8 MMA whose int32 result is the
block's exact dot of codes (twice the E2M1 values, |sum| <= 32 * 12 * 12), so the decode of a
weight is shared by every pair of its expert in the program, and its products cost nothing on
the CUDA cores:

- pairs are grouped by expert (`moe_align_block_size`, blocks of BLOCK_M = 8 or 16 pairs); a program takes
  one block and ROWS weight rows, swapped so that the weight rows are the MMA's M axis (mma.sync
  m16n8k32 with the decoded weights as the A operand, straight from the lookup's registers) and the
  block's pairs its N axis;
- weights: each 16-byte row block becomes int8 codes in registers, by prmt table lookups
  (`_mxfp4.e2m1_split_codes_ptx`): one lookup gives the positive codes' magnitudes, one on the
  codes with their sign bits flipped the negative ones, so the sign is not applied per weight:
  the MMA's K axis holds both, [magnitudes of positive codes | of negative codes] (K = 64), against
  activations [codes | negated codes] that `quantize_rows(mma_layout=True)` writes once a row
  (element order: see `_weight_codes`);
- scaling: each block's int32 dot d is read through the accumulator initialised to 3.0's bits
  (0x40400000, which Triton folds into the MMA's C operand): as fp32 that is 3 + d * 2^-22 exactly,
  so one fma with the activation scale s and -3s gives d * 2^-22 * s and a second adds it times
  the weight scale to the fp32 accumulator; no int-to-float conversion (slow on Hopper). Every
  step is exact for all E8M0 bytes but an activation scale of 2^127 (a block whose |x| reaches
  1.75 * 2^127, above bf16 / fp32 activations' practical range): each block's value is the
  dequantizing reference's fp32 block sum, bit for bit, times 2^-20 (2^-22, and the codes are twice
  the values); the accumulator is scaled back once (x 2^20) before the epilogue;
- kernel 1 writes silu(gate) * up per pair, `quantize_rows` quantizes h, kernel 2 writes each
  pair's routing weight x h @ W2[e]^T in x's dtype and `sum_slots` (expert-GEMV path) adds a
  token's slots in fp32 in slot order.

NVIDIA only (PTX lookup, mma.sync register layouts; the interpreter runs the same tiles with a
portable code lookup, for the CPU tests). Decisions from shapes only: graph-capturable.

Status (docs/benchmarks.md section 6): the first form of this path (4 warps, so wgmma, codes in
quantize_rows' paired order) measured 33-39% of copy on a Kimi TP8 rank and 41-47% at full width on
an H100, slower than the best other path at every T from 1 to 512, so the dispatch never takes it.
This form (mma.sync, element order, 8-pair blocks where experts get few pairs: 3.1 instructions a
weight in the sm_90 gate/up loop at 8 pairs and 4.0 at 16, against 4.8 at 16 with wgmma, and no
warpgroup-wide waits) is compiled and CPU-tested but not yet GPU-run:
`python ci/bench_mxfp4_expert_gemv.py --sweep` times it against every other path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._mxfp4 import MX_BLOCK, e2m1_split_codes, e2m1_split_codes_ptx, silu_mul
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import INTERPRET
from kernels_rocm.fused_moe import moe_align_block_size
from kernels_rocm.mxfp4_moe_decode import quantize_rows
from kernels_rocm.mxfp4_moe_expert_gemv import _pair_rows, sum_slots

# fp32 3.0: the int32 block dot d added to its bits is 3 + d * 2^-22 (ulp 2^-22 on [2, 4), |d| < 2^21)
MAGIC_BITS = tl.constexpr(0x40400000)
MAGIC = tl.constexpr(3.0)
UNSCALE = tl.constexpr(2.0**20)  # the accumulators hold (4 x value) * 2^-22: the codes are twice the values


@dataclass(frozen=True)
class IntMmaConfig:
    """Launch shape: `block_m` pairs of one expert a program (the routing alignment's block and the
    MMA's N: 8 or more), `*_rows` weight rows a program (16 or more per warp; gate_up_rows counts
    intermediate rows, each a gate and an up row), `warps` warps a program (1 or 2: Triton 3.6 takes
    4 warps over 64 rows to wgmma, whose warpgroup-wide issue and wait measured slower), `k_blocks`
    32-element K blocks a loop step (1, 2 or 4; fewer where K / 32 is not a multiple), `stages`
    software-pipelining depth of the loads."""

    block_m: int = 16
    gate_up_rows: int = 64
    down_rows: int = 64
    warps: int = 2
    k_blocks: int = 4
    stages: int = 3


def default_config(num_pairs: int, num_experts: int) -> IntMmaConfig:
    """Blocks of 8 pairs while experts get about 6 pairs or fewer on average, else 16. Reasoned from
    the sm_90 loop (not yet measured): each pair of a block adds 3 instructions per 32 weights a lane
    (the block scaling of its result), so the gate/up loop costs 3.0 instructions a weight at 8
    pairs and 4.0 at 16, and an expert's weights are decoded once per block of its pairs; with
    Poisson-like loads of 6 pairs an expert the two sizes cost about the same."""
    return IntMmaConfig(block_m=8 if num_pairs <= 6 * num_experts else 16)


@triton.jit
def _split_blocks(v, KB: tl.constexpr):
    """[R, KB] (KB 1, 2 or 4, in each thread's registers) -> KB tensors [R], block order."""
    if KB == 1:
        return (tl.reshape(v, [v.shape[0]]),)
    elif KB == 2:
        a, b = tl.split(v)
        return (a, b)
    else:
        even, odd = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
        b0, b2 = tl.split(even)
        b1, b3 = tl.split(odd)
        return (b0, b1, b2, b3)


@triton.jit
def _weight_codes(w_ptrs, ROWS: tl.constexpr, PTX: tl.constexpr):
    """w_ptrs [ROWS, 16]: one 32-element block's packed bytes a row -> int8 [ROWS, 64], the A
    operand: twice the magnitudes of the block's positive codes (0 elsewhere), then those of its
    negative codes, each in element order. Element order is what keeps the lookup in registers:
    mma.sync's int8 operand gives each lane 8 consecutive K elements (Triton's kWidth 8), here the
    8 codes of one packed word."""
    packed = tl.load(w_ptrs)
    if PTX:
        pos_lo, pos_hi, neg_lo, neg_hi = e2m1_split_codes_ptx(packed)
    else:
        pos_lo, pos_hi, neg_lo, neg_hi = e2m1_split_codes(packed, ROWS, 16)
    codes = tl.join(tl.join(pos_lo, pos_hi), tl.join(neg_lo, neg_hi))  # [ROWS, word * 4 + i, h, sign]
    return tl.reshape(tl.permute(tl.reshape(codes, [ROWS, 4, 4, 2, 2]), [0, 4, 1, 3, 2]), [ROWS, 64])


@triton.jit
def _block_dot(w_codes, a_codes, a_scale, a_bias, w_scale, acc):
    """acc [ROWS, M] + the block's value x 2^-22 x 4: w_codes [ROWS, 64] @ a_codes [64, M] exactly in
    int32, read as 3 + d * 2^-22 (fp32 bits), times the activation scale a_scale [M] minus a_bias
    (3 x a_scale), times the weight scale w_scale [ROWS]."""
    d = tl.dot(w_codes, a_codes, out_dtype=tl.int32)
    t = tl.fma((d + MAGIC_BITS).to(tl.float32, bitcast=True), a_scale[None, :], a_bias[None, :])
    return tl.fma(t, w_scale[:, None], acc)


@triton.jit
def _row_tile(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se, stride_sn, ROWS: tl.constexpr):
    """This program's weight rows (program_id(1); clamped to N - 1, so the loads need no mask),
    their validity, pointers to their first block's 16 bytes [ROWS, 16] and scale byte [ROWS]."""
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    safe = tl.minimum(rows, N - 1).to(tl.int64)
    w_rows = w_ptr + expert * stride_we + safe[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    return rows, rows < N, w_rows, s_ptr + expert * stride_se + safe * stride_sn


@triton.jit
def _weight_scale(s_ptrs):
    """E8M0 bytes -> fp32 2^(byte - 127) in two instructions, exact for bytes 0..254 (0 is the
    subnormal 2^-127); byte 255 (NaN, which no quantizer writes) gives +inf, so a block under it
    comes out +-inf or NaN, not NaN alone (`_mxfp4.e8m0_to_fp32`, the exact one, takes five)."""
    return tl.maximum(tl.load(s_ptrs).to(tl.int32) << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def _act_tile(a_ptr, as_ptr, act_rows, stride_am, stride_asm, KB: tl.constexpr):
    """Pointers to the block's activation codes, first K block [M, 64], and scales [M, KB]."""
    a = a_ptr + act_rows[:, None] * stride_am + tl.arange(0, 64)[None, :]
    s = as_ptr + act_rows[:, None] * stride_asm + tl.arange(0, KB)[None, :]
    return a, s


@triton.jit
def _act_scales(s_ptrs, KB: tl.constexpr):
    """One loop step's activation scales and biases (3 x scale): two KB-tuples of [M] fp32."""
    scales = tl.load(s_ptrs)
    return _split_blocks(scales, KB), _split_blocks(scales * -MAGIC, KB)


@triton.jit(do_not_specialize=["num_pairs"])
def _int_mma_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, N, K,  # N = intermediate size I (gate rows [0, N), up rows [N, 2N)), K = hidden size
    stride_xm: tl.int64, stride_xsm: tl.int64, stride_we: tl.int64, stride_wn: tl.int64,
    stride_se: tl.int64, stride_sn: tl.int64, stride_hm: tl.int64,
    TOP_K: tl.constexpr, PTX: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, KB: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    used, expert, pairs, pair_valid = _pair_rows(sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if used:  # blocks past the aligned length (a static upper bound) do nothing
        rows, row_valid, w_gate, s_gate = _row_tile(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se,
                                                    stride_sn, ROWS)
        w_up = w_gate + N * stride_wn
        s_up = s_gate + N * stride_sn
        # padding pairs read token 0 (any row does: their columns are never stored)
        x_codes, x_scales = _act_tile(x_ptr, xs_ptr, tl.where(pair_valid, pairs // TOP_K, 0), stride_xm, stride_xsm, KB)
        gate = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
        up = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
        for kb0 in range(0, K // 32, KB):
            a_scale, a_bias = _act_scales(x_scales + kb0, KB)
            for j in tl.static_range(KB):
                a = tl.trans(tl.load(x_codes + (kb0 + j) * 64))
                gate = _block_dot(_weight_codes(w_gate + (kb0 + j) * 16, ROWS, PTX), a, a_scale[j], a_bias[j],
                                  _weight_scale(s_gate + kb0 + j), gate)
                up = _block_dot(_weight_codes(w_up + (kb0 + j) * 16, ROWS, PTX), a, a_scale[j], a_bias[j],
                                _weight_scale(s_up + kb0 + j), up)
        h = silu_mul(gate * UNSCALE, up * UNSCALE, h_ptr.dtype.element_ty)  # [ROWS, M]
        tl.store(h_ptr + pairs[None, :] * stride_hm + rows[:, None], h, mask=pair_valid[None, :] & row_valid[:, None])


@triton.jit(do_not_specialize=["num_pairs"])
def _int_mma_down_kernel(
    h_ptr, hs_ptr, w_ptr, s_ptr, part_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, N, K,  # N = hidden size H (output rows), K = intermediate size I
    stride_hm: tl.int64, stride_hsm: tl.int64, stride_we: tl.int64, stride_wn: tl.int64,
    stride_se: tl.int64, stride_sn: tl.int64, stride_pm: tl.int64,
    PTX: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    used, expert, pairs, pair_valid = _pair_rows(sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if used:
        rows, row_valid, w_rows, s_rows = _row_tile(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se,
                                                    stride_sn, ROWS)
        h_codes, h_scales = _act_tile(h_ptr, hs_ptr, tl.where(pair_valid, pairs, 0), stride_hm, stride_hsm, KB)
        acc = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
        for kb0 in range(0, K // 32, KB):
            a_scale, a_bias = _act_scales(h_scales + kb0, KB)
            for j in tl.static_range(KB):
                a = tl.trans(tl.load(h_codes + (kb0 + j) * 64))
                acc = _block_dot(_weight_codes(w_rows + (kb0 + j) * 16, ROWS, PTX), a, a_scale[j], a_bias[j],
                                 _weight_scale(s_rows + kb0 + j), acc)
        weight = tl.load(topk_weights_ptr + pairs, mask=pair_valid, other=0.0)
        out = acc * (weight * UNSCALE)[None, :]
        tl.store(part_ptr + pairs[None, :] * stride_pm + rows[:, None], out.to(part_ptr.dtype.element_ty),
                 mask=pair_valid[None, :] & row_valid[:, None])


def _k_blocks(k: int, most: int) -> int:
    """The most K blocks a loop step (<= `most`, a power of two) that divides k / 32."""
    kb = most
    while (k // MX_BLOCK) % kb:
        kb //= 2
    return kb


def _check(cfg: IntMmaConfig) -> None:
    if cfg.block_m < 8 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"IntMmaConfig.block_m must be a power of two >= 8, got {cfg.block_m}")
    if cfg.warps not in (1, 2):
        raise ValueError(f"IntMmaConfig.warps must be 1 or 2, got {cfg.warps}")
    for name in ("gate_up_rows", "down_rows"):
        rows = getattr(cfg, name)
        if rows < 16 * cfg.warps or rows & (rows - 1):
            raise ValueError(f"IntMmaConfig.{name} must be a power of two >= 16 a warp, got {rows}")
    if cfg.k_blocks not in (1, 2, 4):
        raise ValueError(f"IntMmaConfig.k_blocks must be 1, 2 or 4, got {cfg.k_blocks}")
    if cfg.stages < 1:
        raise ValueError(f"IntMmaConfig.stages must be >= 1, got {cfg.stages}")


def fused_moe_mxfp4_int_mma(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, config: IntMmaConfig | None = None,
) -> torch.Tensor:
    """The W4A4 tensor-core path on inputs `mxfp4_moe.fused_moe_mxfp4` has checked; writes out."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_pairs, num_experts)
    _check(cfg)
    ptx = not INTERPRET
    launch = dict(num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch_args(x.device))
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    blocks = expert_ids.shape[0]
    x_codes, x_scales = quantize_rows(x, mma_layout=True)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _int_mma_gate_up_kernel[(blocks, triton.cdiv(inter, cfg.gate_up_rows))](
        x_codes, x_scales, w13, w13_scale, h, sorted_ids, expert_ids, num_padded,
        num_pairs, inter, hidden, x_codes.stride(0), x_scales.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), h.stride(0),
        TOP_K=top_k, PTX=ptx, BLOCK_M=cfg.block_m, ROWS=cfg.gate_up_rows, KB=_k_blocks(hidden, cfg.k_blocks), **launch,
    )
    h_codes, h_scales = quantize_rows(h, mma_layout=True)
    partial = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _int_mma_down_kernel[(blocks, triton.cdiv(hidden, cfg.down_rows))](
        h_codes, h_scales, w2, w2_scale, partial, topk_weights, sorted_ids, expert_ids, num_padded,
        num_pairs, hidden, inter, h_codes.stride(0), h_scales.stride(0), w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), partial.stride(0),
        PTX=ptx, BLOCK_M=cfg.block_m, ROWS=cfg.down_rows, KB=_k_blocks(inter, cfg.k_blocks), **launch,
    )
    return sum_slots(partial, topk_ids, num_experts, out)
