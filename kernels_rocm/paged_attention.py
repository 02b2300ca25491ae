"""Paged attention for MHA/GQA over [num_blocks, block_size, kv_heads, head_dim] caches.

One kernel serves prefill, chunked prefill over a cached prefix, decode, speculative verify and
mixed batches: query row j of sequence b sits at position context_lens[b] - q_len[b] + j and sees
cache positions 0 ..= that position. Layout, grid and split-KV scheme are described in
`_attention_common` (vLLM unified-attention structure: GQA heads packed into the M tile, a tile
loop over the block table, fp32 online softmax; split-KV for short query blocks at long context).

Every cache offset is int64: block ids are loaded as int32 and widened before they meet a stride,
which is what keeps block ids >= 65,536 with a 32 KiB block stride (and pools past 4 GiB) right.

FP8 caches (e4m3fn / e4m3fnuz, one fp32 scale per K and per V cache, see kv_cache) are read as
fp8 and upcast exactly to fp16 for the dots (q and the probabilities too; fp32 accumulation);
the scales are applied to the scores (k_scale joins the softmax scale) and to the output
(v_scale), which is the same math as dequantizing every element, done once per row instead of
once per cache element.
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
    num_compute_units,
)

# A verify step's rows of a sequence share one program only from this many (sequence, KV head)
# programs a compute unit: fewer, and splitting the rows over programs is the better parallelism.
# H100, 8B shape (8 KV heads), q = 5 / 6 (ci/bench_verify_attention.py, 2026-11-27): one program a
# sequence 11-20% faster at batch 96 and 128 (768 and 1,024 programs, 1k-4k contexts), 6-11% slower
# at batch 64 (512), mixed at 32.
VERIFY_ONE_TILE_PROGRAMS_PER_CU = 5


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, k_scale_ptr, v_scale_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    query_start_loc_ptr, context_lens_ptr, block_tables_ptr,
    num_seqs, num_heads, qk_scale,
    stride_q_t: tl.int64, stride_q_h: tl.int64,
    stride_k_blk: tl.int64, stride_k_tok: tl.int64, stride_k_h: tl.int64,
    stride_v_blk: tl.int64, stride_v_tok: tl.int64, stride_v_h: tl.int64,
    stride_out_t: tl.int64, stride_out_h: tl.int64,
    stride_bt: tl.int64,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows of the M tile = BLOCK_Q query rows x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_N: tl.constexpr,  # KV tokens per loop iteration
    NUM_SEGMENTS: tl.constexpr,
    FP8: tl.constexpr,  # caches hold fp8: upcast on load, scales from k_scale_ptr / v_scale_ptr
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq, q_start, q_len, q_block, context_len = locate_q_block(
        query_start_loc_ptr, context_lens_ptr, tl.program_id(0), num_seqs, BLOCK_Q
    )
    if q_block * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    row = q_block * BLOCK_Q + offs_m // GROUP  # query row within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (row < q_len)
    token = q_start + row
    last_visible = context_len - q_len + row  # causal bound, also the end of the cache

    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + token.to(tl.int64)[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    elif FP8:  # fp16 dots: e4m3 -> fp16 is one exact conversion per two elements, -> bf16 is not
        q = q.to(tl.float16)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # Tokens this q block needs: up to the last visible position of its last valid row.
    kv_end = context_len - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    first_tile, last_tile = segment_tile_range(kv_end, segment, TILE_N, NUM_SEGMENTS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_k_h
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_v_h
    offs_n = tl.arange(0, TILE_N)
    for tile in range(first_tile, last_tile):
        pos = tile * TILE_N + offs_n
        pos_valid = pos < kv_end
        block_id = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(
            k_head_ptr + (block_id * stride_k_blk + in_block * stride_k_tok)[None, :] + offs_d[:, None],
            mask=pos_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_head_ptr + (block_id * stride_v_blk + in_block * stride_v_tok)[:, None] + offs_d[None, :],
            mask=pos_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        if FP8 or UPCAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(pos[None, :] <= last_visible[:, None], scores, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    if FP8:
        acc = acc * tl.load(v_scale_ptr)
    store_rows(
        acc, m_i, l_i, row_valid, token, head, segment,
        out_ptr, stride_out_t, stride_out_h,
        part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads,
        HEAD_DIM, HEAD_PAD, NUM_SEGMENTS,
    )


def _check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> None:
    check_tensor("q", q, 3, SUPPORTED_DTYPES)
    check_tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES + FP8_DTYPES)
    check_tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES + FP8_DTYPES)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or (k_cache.dtype not in FP8_DTYPES and q.dtype != k_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache dtypes must match (or both caches be fp8), got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    check_kv_scale("k_scale", k_scale, "k_cache", k_cache)
    check_kv_scale("v_scale", v_scale, "v_cache", v_cache)
    num_kv_heads = k_cache.shape[2]
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads (shape {tuple(q.shape)}), not a multiple of k_cache's "
            f"{num_kv_heads} kv heads (shape {tuple(k_cache.shape)})"
        )
    check_dim("q", q, 2, k_cache.shape[3], "k_cache's head dim")
    check_out(out, q, "q", SUPPORTED_DTYPES)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, out=out)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal paged attention; returns out [T, Hq, D] in q's dtype (or writes `out`).

    q [T, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D] (strided views of a pool are fine); Hq a
    multiple of Hkv. query_start_loc [B+1] int32, context_lens [B] int32 (KV length after this
    step's writes), block_tables [B, max_blocks] int32; max_query_len / max_context_len are host
    upper bounds that size the grid, so the call is graph-capturable. `num_kv_splits` (power of
    two) overrides the split-KV heuristic. fp8 caches need k_scale / v_scale (1-element fp32
    tensors): an entry reads as entry * scale.
    """
    _check_inputs(q, k_cache, v_cache, out, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_metadata(num_tokens, query_start_loc, context_lens, block_tables, max_query_len, max_context_len, block_size)
    check_same_device(q=q, block_tables=block_tables)  # metadata tensors were checked among themselves
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out

    num_seqs = context_lens.shape[0]
    fp8 = k_cache.dtype in FP8_DTYPES
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    if max_query_len * group >= 128:
        block_m = max(block_m, 64)  # prefill: bigger M tiles reuse each KV tile more
    elif max_query_len > 1 and (num_seqs * num_kv_heads
                                >= VERIFY_ONE_TILE_PROGRAMS_PER_CU * num_compute_units(q.device)):
        # a verify step's k + 1 rows a sequence in one program where they fit in 64 rows, once there
        # are programs enough without splitting them: a program per 16 / group rows reads the
        # sequence's KV once per program (8B shape, group 4, k = 4, H100: batch 128 at 2k context
        # 546 -> 484 us), while in smaller batches the extra programs pay (batch 64: 286 -> 316 us
        # with one program)
        block_m = max(block_m, min(64, triton.next_power_of_2(max_query_len * group)))
    block_q = block_m // group
    head_pad = max(16, triton.next_power_of_2(head_dim))

    active_programs = num_seqs * triton.cdiv(max_query_len, block_q) * num_kv_heads
    num_kv_splits, split, partials = plan_split(
        num_kv_splits, active_programs, max_query_len, max_context_len, out, head_pad
    )

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_kv_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, k_scale if fp8 else q, v_scale if fp8 else q,
        *partials,
        query_start_loc, context_lens, block_tables,
        num_seqs, num_heads, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE_N=32,
        NUM_SEGMENTS=num_kv_splits,
        FP8=fp8, UPCAST=UPCAST_DOT,
        DOT_PRECISION=dot_precision(torch.float16 if fp8 and not UPCAST_DOT else q.dtype),
        num_warps=8 if block_m >= 64 else 4,
        num_stages=1 if IS_HIP else 2,
        **pdl.launch_args(q.device),
    )
    if split is not None:
        split.merge_into(out, head_dim)
    return out
