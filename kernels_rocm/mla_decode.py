"""MLA attention in the absorbed form over a paged latent cache [num_blocks, block_size, L + R].

Every query head attends to the single latent row per token (MQA): scores use the full row
(q_latent . c_kv + q_pe . k_pe, two dots so L and R need not be one power of two) and the values
are the first L columns of the same row, so each KV tile is loaded once and used for both dots.
Query heads are packed BLOCK_H (<= 16) per program as in sglang's grouped stage-1 kernel; larger
head counts use several head groups (grid axis 1), each re-reading the latent rows.

Decode, speculative verify (k + 1 rows per sequence, causal among them), prefill over a cached
prefix and mixed batches use the same causal rule and the same q-block / split-KV scheme as the
MHA kernel (see `_attention_common`). Cache offsets are int64 (block ids >= 65,536 are safe).

An fp8 cache (one fp32 scale for the whole latent row) is read as fp8, half the bytes of bf16,
and upcast exactly to fp16 for the dots (q and the probabilities too, fp32 accumulation); the
scale multiplies the scores and the output instead of every element. On CUDA (e4m3fn) the tile
is async-copied as fp8, upcast once by `e4m3fn_to_f16_ptx` and staged in shared memory as fp16,
so both dots read it as they read a bf16 tile; ROCm and the interpreter use Triton's conversion.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm._attention_common import (
    LOG2E,
    check_metadata,
    locate_q_block,
    online_softmax_step,
    plan_split,
    segment_tile_range,
    store_rows,
)
from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import (
    FP8_DTYPES,
    IS_HIP,
    SUPPORTED_DTYPES,
    UPCAST_DOT,
    check_dim,
    check_kv_scale,
    check_out,
    check_same_device,
    check_tensor,
    dot_precision,
)

MAX_HEADS_PER_PROGRAM = 16  # a [16, 512] fp32 accumulator is what fits registers comfortably


@triton.jit
def e4m3fn_to_f16_ptx(x):
    """e4m3fn -> fp16 (exact), two elements an instruction, as a layout barrier.

    Written with Triton's own conversion, the upcast is moved into the dot-operand layout (to
    save a shared-memory round trip) and the operand's kWidth follows the 8-bit origin, so the
    value tile, needed with tokens along K, is read from shared memory byte by byte (sm_90 has
    no 8-bit ldmatrix.trans), while the async-copy pipeline skips the tile. Inline asm marked
    impure is neither moved nor looked through: the tile is async-copied as fp8, upcast once in
    registers, stored as fp16 and read by both dots with ldmatrix / ldmatrix.trans, as bf16 is.
    sm_90 decode loop per 32 tokens: 2,592 warp-instructions (4 warps) instead of 6,288 (8 warps,
    64 LDS.U8 each); tests/test_kernels_compile.py checks the SASS.
    """
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
    )


@triton.jit(do_not_specialize=["num_seqs"])
def _mla_attention_kernel(
    q_latent_ptr, q_pe_ptr, kv_cache_ptr, out_ptr, kv_scale_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    query_start_loc_ptr, context_lens_ptr, block_tables_ptr,
    num_seqs, num_heads, qk_scale,
    stride_ql_t: tl.int64, stride_ql_h: tl.int64,
    stride_qp_t: tl.int64, stride_qp_h: tl.int64,
    stride_kv_blk: tl.int64, stride_kv_tok: tl.int64,
    stride_out_t: tl.int64, stride_out_h: tl.int64,
    stride_bt: tl.int64,
    BLOCK_H: tl.constexpr,  # query heads per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q query rows x BLOCK_H heads
    BLOCK_Q: tl.constexpr,
    LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr,
    ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    FP8: tl.constexpr,  # the cache holds fp8 rows, dequantization scale at kv_scale_ptr
    FP8_PTX: tl.constexpr,  # e4m3fn rows on CUDA: upcast with e4m3fn_to_f16_ptx
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_BLOCK_IDS: tl.constexpr,  # CUDA, see the loop (ROCm: one stage, and gfx950 fp8 spills 3 VGPRs)
):
    wait_for_previous_kernel(PDL)
    head_group = tl.program_id(1)
    segment = tl.program_id(2)
    seq, q_start, q_len, q_block, context_len = locate_q_block(
        query_start_loc_ptr, context_lens_ptr, tl.program_id(0), num_seqs, BLOCK_Q
    )
    if q_block * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    row = q_block * BLOCK_Q + offs_m // BLOCK_H
    head = head_group * BLOCK_H + offs_m % BLOCK_H
    row_valid = (offs_m // BLOCK_H < BLOCK_Q) & (row < q_len) & (head < num_heads)
    token = q_start + row
    last_visible = context_len - q_len + row

    offs_l = tl.arange(0, LATENT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    l_valid = offs_l < LATENT_DIM
    r_valid = offs_r < ROPE_DIM
    token64 = token.to(tl.int64)
    q_lat = tl.load(
        q_latent_ptr + token64[:, None] * stride_ql_t + head[:, None] * stride_ql_h + offs_l[None, :],
        mask=row_valid[:, None] & l_valid[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + token64[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_r[None, :],
        mask=row_valid[:, None] & r_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    elif FP8:  # fp16 dots: e4m3 -> fp16 is one exact conversion per two elements, -> bf16 is not
        q_lat = q_lat.to(tl.float16)
        q_pe = q_pe.to(tl.float16)
    if FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)

    kv_end = context_len - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    first_tile, last_tile = segment_tile_range(kv_end, segment, TILE_N, NUM_SEGMENTS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    # Block ids one tile ahead: loaded in the same iteration, the next tile's async copies waited
    # for them and the P.V dot waited behind those copies (a chain of dependent L2 round trips
    # per tile in sm_90 SASS); carried over, they have a whole tile of compute to arrive.
    if PREFETCH_BLOCK_IDS:
        next_pos = first_tile * TILE_N + offs_n
        next_block_id = tl.load(block_table_row + next_pos // BLOCK_SIZE, mask=next_pos < kv_end, other=0)
    for tile in range(first_tile, last_tile):
        pos = tile * TILE_N + offs_n
        pos_valid = pos < kv_end
        if PREFETCH_BLOCK_IDS:
            block_id = next_block_id.to(tl.int64)
            next_pos = pos + TILE_N
            next_block_id = tl.load(block_table_row + next_pos // BLOCK_SIZE, mask=next_pos < kv_end, other=0)
        else:
            block_id = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        kv_row = kv_cache_ptr + block_id * stride_kv_blk + (pos % BLOCK_SIZE).to(tl.int64) * stride_kv_tok
        c_kv = tl.load(
            kv_row[:, None] + offs_l[None, :], mask=pos_valid[:, None] & l_valid[None, :], other=0.0
        )  # [TILE_N, LATENT_PAD]: keys (transposed below) and values
        k_pe = tl.load(
            kv_row[:, None] + LATENT_DIM + offs_r[None, :], mask=pos_valid[:, None] & r_valid[None, :], other=0.0
        )
        if FP8_PTX:
            c_kv = e4m3fn_to_f16_ptx(c_kv)
            k_pe = e4m3fn_to_f16_ptx(k_pe)
        else:
            c_kv = c_kv.to(q_lat.dtype)
            k_pe = k_pe.to(q_lat.dtype)
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(pos[None, :] <= last_visible[:, None], scores, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_lat.dtype), c_kv, input_precision=DOT_PRECISION)

    if FP8:
        acc = acc * tl.load(kv_scale_ptr)
    store_rows(
        acc, m_i, l_i, row_valid, token, head, segment,
        out_ptr, stride_out_t, stride_out_h,
        part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads,
        LATENT_DIM, LATENT_PAD, NUM_SEGMENTS,
    )


def upcasts_with_ptx(kv_dtype: torch.dtype) -> bool:
    """Whether an fp8 cache of `kv_dtype` is upcast by `e4m3fn_to_f16_ptx` (e4m3fn on CUDA, where
    Triton accepts e4m3fn only from sm_89, which has the instruction). Elsewhere Triton's own
    conversion runs: on ROCm (e4m3fnuz on gfx942, e4m3fn on gfx950) and in the interpreter."""
    return kv_dtype == torch.float8_e4m3fn and not IS_HIP and not UPCAST_DOT


def launch_options(kv_dtype: torch.dtype) -> tuple[int, int, int]:
    """(KV tokens per tile, warps, pipeline stages) for a cache of `kv_dtype`. ROCm: a 32 x 576
    bf16 tile per stage overflows MI300's 64 KB LDS. CUDA: the PTX fp8 path stages the tile as
    bf16 is staged and fits 4 warps (252 / 254 registers fp8 / bf16 on sm_90: two programs an SM,
    limited by the registers, not by the 92 / 93 KB of shared memory of 3 stages); Triton's fp8 upcast in
    the dot-operand layout spills with 4 warps (255 + spill), so it takes 8. Three stages over
    two: H100, batch 64 / 32k, fp8 845 -> 830 us, bf16 886 -> 839 us (docs/benchmarks.md section 6)."""
    fp8 = kv_dtype in FP8_DTYPES
    if IS_HIP:
        return (16, 8, 1) if fp8 else (16, 4, 1)
    if fp8 and not upcasts_with_ptx(kv_dtype):
        return 32, 8, 2
    return 32, 4, 3


def _check_inputs(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
) -> None:
    check_tensor("q_latent", q_latent, 3, SUPPORTED_DTYPES)
    check_tensor("q_pe", q_pe, 3, SUPPORTED_DTYPES)
    check_tensor("kv_cache", kv_cache, 3, SUPPORTED_DTYPES + FP8_DTYPES)
    check_dim("q_pe", q_pe, 0, q_latent.shape[0], "q_latent's tokens")
    check_dim("q_pe", q_pe, 1, q_latent.shape[1], "q_latent's heads")
    check_dim("kv_cache", kv_cache, 2, q_latent.shape[2] + q_pe.shape[2], "q_latent width + q_pe width")
    if q_latent.dtype != q_pe.dtype or (kv_cache.dtype not in FP8_DTYPES and q_latent.dtype != kv_cache.dtype):
        raise ValueError(
            f"q_latent, q_pe and kv_cache dtypes must match (or kv_cache be fp8), got "
            f"{q_latent.dtype}, {q_pe.dtype}, {kv_cache.dtype}"
        )
    check_kv_scale("kv_scale", kv_scale, "kv_cache", kv_cache)
    check_out(out, q_latent, "q_latent", SUPPORTED_DTYPES)
    check_same_device(q_latent=q_latent, q_pe=q_pe, kv_cache=kv_cache, out=out)


def mla_paged_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention; returns out [T, N, L] in q's dtype (or writes `out`).

    q_latent [T, N, L] (q_nope already multiplied by W_UK), q_pe [T, N, R] (after RoPE),
    kv_cache [NB, BS, L + R] latent rows (c_kv | k_pe). Metadata as in `paged_attention`;
    `scale` is the model's softmax scale (1/sqrt(nope + rope) for DeepSeek-V3/Kimi); an fp8
    cache needs `kv_scale` (1-element fp32 tensor): an entry reads as entry * kv_scale.
    """
    _check_inputs(q_latent, q_pe, kv_cache, out, kv_scale)
    num_tokens, num_heads, latent_dim = q_latent.shape
    rope_dim = q_pe.shape[2]
    block_size = kv_cache.shape[1]
    check_metadata(num_tokens, query_start_loc, context_lens, block_tables, max_query_len, max_context_len, block_size)
    check_same_device(q_latent=q_latent, block_tables=block_tables)  # metadata was checked among itself
    if out is None:
        out = torch.empty_like(q_latent)
    if num_tokens == 0:
        return out

    num_seqs = context_lens.shape[0]
    fp8 = kv_cache.dtype in FP8_DTYPES
    block_h = min(triton.next_power_of_2(num_heads), MAX_HEADS_PER_PROGRAM)
    block_m = 16
    block_q = block_m // block_h
    head_groups = triton.cdiv(num_heads, block_h)
    latent_pad = max(16, triton.next_power_of_2(latent_dim))
    rope_pad = max(16, triton.next_power_of_2(rope_dim))

    active_programs = num_seqs * triton.cdiv(max_query_len, block_q) * head_groups
    num_kv_splits, split, partials = plan_split(
        num_kv_splits, active_programs, max_query_len, max_context_len, out, latent_pad, programs_per_compute_unit=2
    )

    tile_n, num_warps, num_stages = launch_options(kv_cache.dtype)
    grid = (num_tokens // block_q + num_seqs, head_groups, num_kv_splits)
    _mla_attention_kernel[grid](
        q_latent, q_pe, kv_cache, out, kv_scale if fp8 else q_latent,
        *partials,
        query_start_loc, context_lens, block_tables,
        num_seqs, num_heads, scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1),
        q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_Q=block_q,
        LATENT_DIM=latent_dim, LATENT_PAD=latent_pad,
        ROPE_DIM=rope_dim, ROPE_PAD=rope_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_kv_splits,
        FP8=fp8, FP8_PTX=upcasts_with_ptx(kv_cache.dtype),
        UPCAST=UPCAST_DOT,
        PREFETCH_BLOCK_IDS=not IS_HIP,
        DOT_PRECISION=dot_precision(torch.float16 if fp8 and not UPCAST_DOT else q_latent.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_args(q_latent.device),
    )
    if split is not None:
        split.merge_into(out, latent_dim)
    return out
