"""Fused MoE for bf16/fp16/fp32 experts: out[t] = sum_k w[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t])).

Pattern of vLLM's fused_moe_kernel:
1. `moe_align_block_size` groups the T*K (token, slot) pairs by expert, each expert's run padded
   to a multiple of BLOCK_M with a sentinel id (T*K), and records the expert of every M block.
   It is one Triton kernel (no host sync, one launch instead of ~25 small torch ops), so it can
   sit inside a captured graph; the padded length is a static upper bound and kernels exit early
   past the real end.
2. Grouped GEMM 1: each program gathers BLOCK_M rows of x, multiplies them by the gate and the
   up rows of its expert's w13 (two accumulators) and writes silu(gate) * up: the activation is
   fused into the epilogue instead of a separate silu-and-mul pass over a [T*K, 2I] buffer.
3. Grouped GEMM 2: the same kernel multiplies the activations by w2 and by the routing weight.
4. The K partial outputs of a token are summed (one torch reduction; deterministic, no atomics).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_rocm._util import (
    IS_HIP,
    SUPPORTED_DTYPES,
    UPCAST_DOT,
    check_dim,
    check_same_device,
    check_tensor,
    dot_precision,
)


ALIGN_CHUNK = 1024  # pairs per loop step of the alignment kernel
ALIGN_BLOCK_ROWS = 32  # M blocks whose expert is found per loop step
# From this many pairs the alignment runs as three kernels over the GPU instead of one program. H100,
# 384 experts (docs/benchmarks.md section 6, "MXFP4 GEMMs at prefill sizes"): 65,536 pairs (Kimi TP8,
# 8,192 tokens x top-8) 457 -> 89 us, 4,096 pairs 48 -> 39 us; at 512 pairs one program is ahead (26 us
# against 35: one launch instead of three and a zeroing).
ALIGN_PARALLEL_PAIRS = 4096


@triton.jit
def _chunk_ids(ids_ptr, start, numel, num_experts, CHUNK: tl.constexpr):
    """A chunk of flat pair ids from `start`: (their offsets, experts, validity); bad ids are
    dropped, never written."""
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=0).to(tl.int32)
    return offs, ids, (offs < numel) & (ids >= 0) & (ids < num_experts)


@triton.jit
def _lay_out_blocks(counts, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr, numel, num_experts,
                    capacity, BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr):
    """From the pairs per expert: pad each count to BLOCK_M, prefix-sum the padded counts into each
    expert's start (its cursor), record the expert of every M block and fill sorted_ids with the
    sentinel."""
    experts = tl.arange(0, EXPERTS_PAD)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.store(cursor_ptr + experts, padded_end - padded, mask=experts < num_experts)
    for first_row in range(0, capacity // BLOCK_M, BLOCK_ROWS):
        rows = first_row + tl.arange(0, BLOCK_ROWS)
        # the expert of a block = number of experts whose padded run ends at or before its start;
        # past the used length that is every expert: -1
        expert = tl.sum((padded_end[None, :] <= rows[:, None] * BLOCK_M).to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(expert_ids_ptr + rows, expert, mask=rows < capacity // BLOCK_M)
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + numel, mask=offs < capacity)


@triton.jit
def _place_pairs(ids_ptr, sorted_ids_ptr, cursor_ptr, start, numel, num_experts, CHUNK: tl.constexpr):
    """Place a chunk of pairs at their experts' cursors (an atomic increment hands out the slots; the
    order inside an expert's run does not matter, each row is computed alone)."""
    offs, ids, valid = _chunk_ids(ids_ptr, start, numel, num_experts, CHUNK)
    slot = tl.atomic_add(cursor_ptr + ids, 1, mask=valid)
    tl.store(sorted_ids_ptr + slot, offs, mask=valid)


@triton.jit(do_not_specialize=["numel", "capacity"])
def _moe_align_kernel(
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr,
    numel, num_experts, capacity,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """One program: count pairs per expert, lay out the blocks, then place every pair."""
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        _, ids, valid = _chunk_ids(ids_ptr, start, numel, num_experts, CHUNK)
        counts += tl.histogram(ids, EXPERTS_PAD, mask=valid)
    _lay_out_blocks(counts, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr, numel, num_experts, capacity,
                    BLOCK_M, EXPERTS_PAD, CHUNK, BLOCK_ROWS)
    tl.debug_barrier()  # cursors and sentinels are written before any pair is placed
    for start in range(0, numel, CHUNK):
        _place_pairs(ids_ptr, sorted_ids_ptr, cursor_ptr, start, numel, num_experts, CHUNK)


# The same in three launches (ALIGN_PARALLEL_PAIRS): a program a chunk counts and places, one lays out.
@triton.jit(do_not_specialize=["numel"])
def _moe_count_kernel(ids_ptr, counts_ptr, numel, num_experts, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr):
    _, ids, valid = _chunk_ids(ids_ptr, tl.program_id(0) * CHUNK, numel, num_experts, CHUNK)
    experts = tl.arange(0, EXPERTS_PAD)
    tl.atomic_add(counts_ptr + experts, tl.histogram(ids, EXPERTS_PAD, mask=valid), mask=experts < num_experts)


@triton.jit(do_not_specialize=["numel", "capacity"])
def _moe_lay_out_kernel(
    counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr, numel, num_experts, capacity,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    _lay_out_blocks(counts, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr, numel, num_experts, capacity,
                    BLOCK_M, EXPERTS_PAD, CHUNK, BLOCK_ROWS)


@triton.jit(do_not_specialize=["numel"])
def _moe_place_kernel(ids_ptr, sorted_ids_ptr, cursor_ptr, numel, num_experts, CHUNK: tl.constexpr):
    _place_pairs(ids_ptr, sorted_ids_ptr, cursor_ptr, tl.program_id(0) * CHUNK, numel, num_experts, CHUNK)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert, padding each expert's run to a multiple of `block_m`.

    Returns
    - sorted_ids [P] int32: flat pair ids (t * K + k), sentinel `topk_ids.numel()` in padding;
      P = numel + E * (block_m - 1) (or numel * block_m when smaller), a static upper bound;
    - expert_ids [P // block_m] int32: expert of each M block, -1 past the real end;
    - num_padded [1] int32: used length of sorted_ids (on device; kernels read it).
    Experts with no pairs take no blocks; ids outside [0, E) are dropped. One kernel launch (three
    and a zeroing from ALIGN_PARALLEL_PAIRS pairs), no host sync: graph-capturable.
    """
    numel = topk_ids.numel()
    device = topk_ids.device
    capacity = numel + num_experts * (block_m - 1)
    capacity = min(capacity, numel * block_m)  # at most `numel` experts are non-empty
    capacity = triton.cdiv(capacity, block_m) * block_m

    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)
    layout = dict(BLOCK_M=block_m, EXPERTS_PAD=triton.next_power_of_2(num_experts), CHUNK=ALIGN_CHUNK,
                  BLOCK_ROWS=ALIGN_BLOCK_ROWS)
    if numel < ALIGN_PARALLEL_PAIRS:
        _moe_align_kernel[(1,)](ids, sorted_ids, expert_ids, num_padded, cursor, numel, num_experts, capacity,
                                **layout, num_warps=8)
        return sorted_ids, expert_ids, num_padded
    chunks = triton.cdiv(numel, ALIGN_CHUNK)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    _moe_count_kernel[(chunks,)](ids, counts, numel, num_experts, EXPERTS_PAD=layout["EXPERTS_PAD"],
                                 CHUNK=ALIGN_CHUNK, num_warps=4)
    _moe_lay_out_kernel[(1,)](counts, sorted_ids, expert_ids, num_padded, cursor, numel, num_experts, capacity,
                              **layout, num_warps=8)
    _moe_place_kernel[(chunks,)](ids, sorted_ids, cursor, numel, num_experts, CHUNK=ALIGN_CHUNK, num_warps=4)
    return sorted_ids, expert_ids, num_padded


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, N, K,
    stride_am: tl.int64, stride_we: tl.int64, stride_wn: tl.int64, stride_cm: tl.int64,
    A_ROWS_PER_PAIR_DIV: tl.constexpr,  # a row = pair id // this (top_k for x, 1 for activations)
    GATE_UP: tl.constexpr,  # w rows [0, N) are gate, [N, 2N) up; write silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_ROWS_PER_PAIR_DIV)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATE_UP:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=pair_valid, other=0.0)[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=pair_valid[:, None] & n_valid[None, :],
    )


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """M tile from the mean pairs per expert: decode wastes little padding with 16, prefill
    reuses each weight tile more with 64."""
    pairs_per_expert = num_pairs / num_experts
    if pairs_per_expert <= 16:
        return 16
    return 32 if pairs_per_expert <= 64 else 64


def _launch_gemm(
    a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_padded: torch.Tensor,
    n: int, a_rows_per_pair_div: int, gate_up: bool, block_m: int,
) -> None:
    k = a.shape[1]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (expert_ids.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, c, topk_weights,
        sorted_ids, expert_ids, num_padded,
        c.shape[0], n, k,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        A_ROWS_PER_PAIR_DIV=a_rows_per_pair_div, GATE_UP=gate_up, MUL_ROUTED_WEIGHT=not gate_up,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=UPCAST_DOT, DOT_PRECISION=dot_precision(a.dtype),
        num_warps=4, num_stages=2 if IS_HIP else 3,
    )


def _check_inputs(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    check_tensor("w13", w13, 3, SUPPORTED_DTYPES)
    check_tensor("w2", w2, 3, SUPPORTED_DTYPES)
    check_tensor("topk_weights", topk_weights, 2, (torch.float32,))
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13 and w2 dtypes must match, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    hidden = x.shape[1]
    check_dim("w13", w13, 2, hidden, "x's hidden size")
    if w13.shape[1] % 2:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}: dim 1 must be 2 * intermediate (gate rows, then up)")
    check_dim("w2", w2, 0, w13.shape[0], "w13's experts")
    check_dim("w2", w2, 1, hidden, "x's hidden size")
    check_dim("w2", w2, 2, w13.shape[1] // 2, "intermediate size, half of w13's dim 1")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids shape {tuple(topk_ids.shape)} must equal topk_weights shape {tuple(topk_weights.shape)}")
    check_dim("topk_ids", topk_ids, 0, x.shape[0], "x's tokens")
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous")
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts: x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I],
    topk_weights [T, K] fp32, topk_ids [T, K] int32/int64 (values in [0, E)). Returns [T, H]
    in x's dtype (or writes `out`). Graph-capturable: no host reads of device values."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    intermediate = two_inter // 2
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if num_tokens == 0:
        return out

    num_pairs = num_tokens * top_k
    block_m = choose_block_m(num_pairs, num_experts)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    activations = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    _launch_gemm(x, w13, activations, topk_weights, sorted_ids, expert_ids, num_padded,
                 intermediate, top_k, True, block_m)
    partial = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch_gemm(activations, w2, partial, topk_weights, sorted_ids, expert_ids, num_padded,
                 hidden, 1, False, block_m)
    torch.sum(partial.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out


def moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Per-expert PyTorch loop: the oracle for `fused_moe` and the baseline of the benchmarks.

    GEMMs run in x's dtype (pass fp32 tensors for an fp32 oracle); the weighted sum over the K
    experts of a token accumulates in fp32. Reads topk_ids on the host (not graph-capturable).
    """
    num_tokens, hidden = x.shape
    intermediate = w13.shape[1] // 2
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = F.linear(x[token], w13[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down = F.linear(act, w2[expert])
        out.index_add_(0, token, down.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)
