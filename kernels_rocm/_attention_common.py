"""Pieces shared by the paged MHA/GQA kernel and the MLA kernel.

Both kernels follow vLLM's unified-attention layout:
- Grid axis 0 enumerates "q blocks" of BLOCK_Q query rows over the whole flat batch, with one
  spare block per sequence, so `T // BLOCK_Q + num_seqs` is an upper bound the host knows
  without reading query lengths; a program finds its sequence by binary search over
  query_start_loc and exits if its block is past the sequence's rows.
- The M tile of a program is BLOCK_Q query rows x GROUP heads that share one KV row, so decode
  (one row per sequence) still feeds tl.dot at least 16 rows and each KV tile is read once per
  group, not once per head.
- Grid axis 2 splits a sequence's KV tiles into NUM_SEGMENTS contiguous segments
  (flash-decoding). With one segment the program normalizes and writes the output; otherwise it
  writes fp32 partials (acc, running max, running sum; log2 domain) that `_merge_segments_kernel`
  folds (launched by `SplitBuffers.merge_into`).
  The segment count is a host constant per launch and the per-sequence split happens on device,
  so a captured graph stays valid when context lengths change.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import check_dim, check_same_device, check_tensor, num_compute_units

LOG2E = 1.4426950408889634

# Split-KV policy. Splitting pays off when the 2D grid cannot fill the GPU (small batches, long
# contexts) and only for short query blocks (decode and speculative verify); prefill has enough
# q blocks to fill the GPU on its own. A decode program walks its KV tiles one after another, so
# at small batch the time is the latency of that walk: measured on an H100 in CUDA graphs
# (docs/benchmarks.md section 8, `ci/bench_kernels.py --splits`), batch 1 at 576 tokens ran
# fastest with 32 splits of ~18 tokens (MHA 6.0 us against 13.7 with the former 256-token
# minimum; MLA 8.7 against 24.0); from there on the grid size, not the tokens per split, decides.
MAX_KV_SPLITS = 128
MIN_TOKENS_PER_SPLIT = 16
MAX_SPLIT_QUERY_LEN = 16
PROGRAMS_PER_COMPUTE_UNIT = 4  # the MHA kernel's best grid; the MLA kernel (8 warps, wide tiles) wants 2


@triton.jit
def locate_q_block(query_start_loc_ptr, context_lens_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """(seq, first flat row of seq, q_len, q block index within seq, context_len) of a program.

    Sequence b owns global q blocks starting at query_start_loc[b] // BLOCK_Q + b; binary search
    for the last sequence whose first block is <= q_block_global.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq)
    context_len = tl.load(context_lens_ptr + seq)
    return seq, q_start, q_len, q_block_local, context_len


@triton.jit
def segment_tile_range(kv_end, segment, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """[first, last) KV tiles of `segment` when `kv_end` tokens are split into NUM_SEGMENTS parts."""
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    first = segment * tiles_per_segment
    last = tl.minimum(first + tiles_per_segment, num_tiles)
    return first, last


@triton.jit
def online_softmax_step(scores, m_i, l_i):
    """Fold a [M, N] tile of log2-domain scores (-inf = masked) into running max/sum.

    Returns (probabilities, rescale factor for the old acc, new max, new sum). A row whose
    scores so far are all masked keeps max -inf; its subtraction uses 0 so no NaN appears.
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def store_rows(
    acc, m_i, l_i, row_valid, token, head, segment,
    out_ptr, stride_out_t, stride_out_h,
    part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    """Write a program's [M, HEAD_PAD] result: normalized into out[token, head, :] with one
    segment, else as fp32 partials [T, H, NUM_SEGMENTS, HEAD_PAD] / [T, H, NUM_SEGMENTS]."""
    offs_d = tl.arange(0, HEAD_PAD)
    mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    token = token.to(tl.int64)
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        ptrs = out_ptr + token[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (token * num_heads + head) * NUM_SEGMENTS + segment
        # All HEAD_PAD columns (zeros past HEAD_DIM): the merge kernel reads whole padded rows.
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)


# Merge tiling. At batch 1 the merge is pure latency: T x H is 8 rows (Kimi TP8 MLA) or 32 (Llama
# MHA), each of NUM_SEGMENTS (up to MAX_KV_SPLITS = 128) partial rows. A loop over segments, one
# scalar max, exp2 and dependent row load after another, took 12.6 us a call in a Kimi TP8 decode
# step at 1k context (64-128 segments, H200, `ci/bench_kimi.py --profile-steps`), twice the MLA
# kernel. So a program takes a BLOCK_D-column slice of one (token, head) row and loads all its
# segments as one [NUM_SEGMENTS, BLOCK_D] tile: the loads of all segments are in flight together
# (from L2, where the attention kernel just wrote the partials), and there are more programs.
# - BLOCK_D = 32 fp32 = 128 bytes: each segment's slice is one whole cache line, and the narrowest
#   slice gives the most programs (MLA at batch 1: 8 heads x 16 slices = 128, about one an SM), so
#   the 2 MB of partials at 128 segments are read through the whole GPU, not through 8 SMs.
# - The tile is at most MAX_KV_SPLITS x 32 = 4096 fp32: 32 values a thread at 4 warps, which
#   leaves room for the rest, so no loop over segment chunks is needed (`ci/compile_kernels.py`,
#   128 segments: 56 registers on sm_90, 40 VGPRs on gfx942, no spills).
# - num_warps: 4, fewer for small tiles (few segments, i.e. large batches) so that a thread keeps
#   at least 8 values (two 16-byte loads) instead of idle replicated lanes.
MERGE_BLOCK_D = 32
MERGE_VALUES_PER_THREAD = 8
MERGE_MAX_WARPS = 4


@triton.jit
def _merge_segments_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    stride_out_t: tl.int64, stride_out_h: tl.int64, num_heads,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, head, d slice] = sum_s 2^(max_s - M) acc_s / sum_s 2^(max_s - M) sum_s, M the
    largest max (0 if all are -inf): empty segments (max -inf) weigh 0, a fully empty row is 0."""
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM  # the padding columns past HEAD_DIM (zeros) are not read
    segments = (token * num_heads + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    # On sm_90 ptxas issues the max load, then the sum and all of the tile's 16-byte loads together
    # (8 a thread at 128 segments) while the max reduces: two round trips, not one a segment.
    seg_max = tl.load(part_max_ptr + segments)
    seg_sum = tl.load(part_sum_ptr + segments)
    tile = tl.load(part_acc_ptr + segments[:, None] * HEAD_PAD + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    global_max = tl.max(seg_max, axis=0)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)
    weights = tl.exp2(seg_max - global_max)  # empty segments (max -inf) weigh 0
    denom = tl.sum(weights * seg_sum, axis=0)
    out = tl.sum(weights[:, None] * tile, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + token * stride_out_t + head * stride_out_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def merge_launch_config(num_segments: int, head_pad: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) of a merge; see MERGE_BLOCK_D."""
    block_d = min(MERGE_BLOCK_D, head_pad)
    return block_d, max(1, min(MERGE_MAX_WARPS, num_segments * block_d // (32 * MERGE_VALUES_PER_THREAD)))


class SplitBuffers:
    """fp32 partial results of a split launch: acc [T, H, S, head_pad], max and sum [T, H, S];
    S a power of two."""

    def __init__(self, num_tokens: int, num_heads: int, num_segments: int, head_pad: int, device: torch.device):
        shape = (num_tokens, num_heads, num_segments)
        self.acc = torch.empty(*shape, head_pad, dtype=torch.float32, device=device)
        self.max = torch.empty(shape, dtype=torch.float32, device=device)
        self.sum = torch.empty(shape, dtype=torch.float32, device=device)

    def merge_into(self, out: torch.Tensor, head_dim: int) -> None:
        num_tokens, num_heads, num_segments, head_pad = self.acc.shape
        block_d, num_warps = merge_launch_config(num_segments, head_pad)
        _merge_segments_kernel[(num_tokens, num_heads, triton.cdiv(head_dim, block_d))](
            self.acc, self.max, self.sum, out,
            out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SEGMENTS=num_segments, BLOCK_D=block_d,
            num_warps=num_warps, **pdl.launch_args(out.device),
        )


def choose_num_segments(
    programs_per_segment: int, max_query_len: int, max_context_len: int, device: torch.device,
    programs_per_compute_unit: int = PROGRAMS_PER_COMPUTE_UNIT,
) -> int:
    """Power-of-two KV split count from host upper bounds only (graph-safe).

    Doubles the split while the grid is below `programs_per_compute_unit` programs per SM/CU and
    every split still gets at least MIN_TOKENS_PER_SPLIT tokens of the longest context.
    """
    if max_query_len > MAX_SPLIT_QUERY_LEN:
        return 1
    target = programs_per_compute_unit * num_compute_units(device)
    splits = 1
    while (
        splits * 2 <= MAX_KV_SPLITS
        and programs_per_segment * splits * 2 <= target
        and max_context_len >= splits * 2 * MIN_TOKENS_PER_SPLIT
    ):
        splits *= 2
    return splits


def plan_split(
    num_kv_splits: int | None,
    programs_per_segment: int,
    max_query_len: int,
    max_context_len: int,
    out: torch.Tensor,
    head_pad: int,
    programs_per_compute_unit: int = PROGRAMS_PER_COMPUTE_UNIT,
) -> tuple[int, SplitBuffers | None, tuple[torch.Tensor, ...]]:
    """(split count, partial buffers or None, the three partial-pointer kernel args).

    `num_kv_splits` None picks the count with `choose_num_segments`; without a split the kernel
    writes `out` directly and its partial-pointer args are unused placeholders.
    """
    if num_kv_splits is None:
        num_kv_splits = choose_num_segments(programs_per_segment, max_query_len, max_context_len, out.device,
                                            programs_per_compute_unit)
    if not (1 <= num_kv_splits <= MAX_KV_SPLITS) or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")
    if num_kv_splits == 1:
        return 1, None, (out, out, out)
    split = SplitBuffers(out.shape[0], out.shape[1], num_kv_splits, head_pad, out.device)
    return num_kv_splits, split, (split.acc, split.max, split.sum)


def check_metadata(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    block_size: int,
) -> None:
    """Shape/dtype checks of the attention metadata fields (values are not read: no host sync)."""
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    num_seqs = context_lens.shape[0]
    check_dim("query_start_loc", query_start_loc, 0, num_seqs + 1, "num_seqs + 1, num_seqs from context_lens")
    check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs from context_lens")
    if max_query_len < 1 or max_query_len > max(num_tokens, 1):
        raise ValueError(f"max_query_len must be in [1, {num_tokens}] (tokens in q), got {max_query_len}")
    if max_context_len < max_query_len:
        raise ValueError(f"max_context_len ({max_context_len}) must be >= max_query_len ({max_query_len})")
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_context_len {max_context_len} exceeds block_tables capacity "
            f"{block_tables.shape[1]} blocks x block size {block_size}"
        )
    check_same_device(query_start_loc=query_start_loc, context_lens=context_lens, block_tables=block_tables)
