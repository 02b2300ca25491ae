"""Advance a decode step's inputs on the device by what the step before it accepted, in one kernel;
and the draft's first inputs from the step's verification, in another.

With overlapped scheduling the host prepares step N + 1 before step N's results are known, so a
sequence that follows step N gets placeholders, and the device fills them in once step N has run:
its first input token is step N's emitted token, the next are step N's draft proposals, and its
positions, cache slots and context length move by step N's accepted count. In torch that is ~20
small kernels (gathers, a concatenation, index writes, the slot arithmetic) between two graph
replays, where the GPU would otherwise go straight on: at batch 1 on the Llama-3.1-8B shape they
were most of the GPU's idle time (docs/benchmarks.md section 8). Here one program per following
sequence does all of it. atom_like.engine.step_inputs.advance_followers is the torch version:
the CPU path (which needs no triton) and the oracle.

`draft_starts` is the same for the draft's first pass: each sequence's last verified row and the
token after it, written straight into the decode graphs' buffers. In torch that was 13 launches and
copies a drafting step (three uploads, index writes, a gather, the padding rows), most of the 19
torch ops that drafting adds to a step outside the graphs; a small model's steps are host-bound, so
each launch is host time (docs/benchmarks.md section 11).
atom_like.engine.step_inputs.draft_starts is its torch version.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import check_same_device, check_tensor


# Every integer that varies between steps is left unspecialized: Triton would otherwise compile a
# variant per batch class (stride_index is the number of followers: == 1, a multiple of 16, other)
# and per verify width (the strides), in the middle of serving, the first time each appears (~90 ms
# a compile on an H100 host, 2026-11-27: what adaptive k's changing widths kept running into). Q, a
# constexpr, is compiled for every width at start-up (`precompile`).
@triton.jit(do_not_specialize=["stride_index", "stride_token", "stride_drafts", "stride_table"])
def _advance_kernel(
    index_ptr, stride_index, accepted_ptr, token_ptr, stride_token, drafts_ptr, stride_drafts,
    input_ids_ptr, positions_ptr, context_lens_ptr, tables_ptr, stride_table, slots_ptr,
    Q: tl.constexpr, Q_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    f = tl.program_id(0)
    src = tl.load(index_ptr + f)
    seq = tl.load(index_ptr + stride_index + f)
    start = tl.load(index_ptr + 2 * stride_index + f)
    accepted = tl.load(accepted_ptr + src).to(tl.int64)
    first = tl.load(token_ptr + src * stride_token + accepted)
    j = tl.arange(0, Q_PAD)
    valid = j < Q
    drafts = tl.load(drafts_ptr + src * stride_drafts + j - 1, mask=valid & (j > 0), other=0)
    cols = start + j
    tl.store(input_ids_ptr + cols, tl.where(j == 0, first, drafts), mask=valid)
    moved = tl.load(positions_ptr + cols, mask=valid, other=0) + accepted
    tl.store(positions_ptr + cols, moved, mask=valid)
    context = tl.load(context_lens_ptr + seq)
    tl.store(context_lens_ptr + seq, context + accepted.to(context.dtype))
    blocks = tl.load(tables_ptr + seq * stride_table + moved // BLOCK_SIZE, mask=valid, other=0)
    tl.store(slots_ptr + cols, blocks.to(tl.int64) * BLOCK_SIZE + moved % BLOCK_SIZE, mask=valid)


def advance(index: torch.Tensor, num_accepted: torch.Tensor, token_ids: torch.Tensor, drafts: torch.Tensor | None,
            input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
            block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """atom_like.engine.step_inputs.advance_followers in one launch (same arguments, same result)."""
    check_tensor("index", index, 2, (torch.int64,))
    check_tensor("token_ids", token_ids, 2, (torch.int64,))
    for name, t in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, t, 1, (torch.int64,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_same_device(index=index, token_ids=token_ids, input_ids=input_ids, block_tables=block_tables)
    if index.shape[0] != 3:
        raise ValueError(f"index has shape {tuple(index.shape)}: expected [3, followers] (source row, batch row, first column)")
    if drafts is not None:
        check_tensor("drafts", drafts, 2, (torch.int32, torch.int64))
    q = 1 + (drafts.shape[1] if drafts is not None else 0)
    followers = index.shape[1]
    if followers == 0:
        return
    _advance_kernel[(followers,)](
        index, index.stride(0), num_accepted, token_ids, token_ids.stride(0),
        drafts if drafts is not None else token_ids, drafts.stride(0) if drafts is not None else 0,
        input_ids, positions, context_lens, block_tables, block_tables.stride(0), slot_mapping,
        Q=q, Q_PAD=triton.next_power_of_2(q), BLOCK_SIZE=block_size, **pdl.launch_args(index.device),
    )


def precompile(device: torch.device, max_query: int, block_size: int, max_rows: int) -> None:
    """Compile the advance kernel for every query width 1..max_query and the draft-start kernel for
    every block of rows up to max_rows (0: none, an engine without drafts), with and without a
    verification (one launch each on scratch tensors), so that a decode step never waits for a
    compile when its verify width or its batch size first appears."""
    zeros = dict(dtype=torch.int64, device=device)
    block = 16
    while max_rows:
        rows = torch.zeros(3, 1, **zeros)
        for sampled in (False, True):
            draft_starts(rows, torch.zeros(1, **zeros) if sampled else None, torch.zeros(1, 1, **zeros),
                         torch.zeros(block, **zeros), torch.zeros(block, **zeros), 1)
        if block >= max_rows:
            break
        block *= 2
    for q in range(1, max_query + 1):
        index = torch.zeros(3, 1, **zeros)
        token_ids = torch.zeros(1, q, **zeros)
        drafts = torch.zeros(1, q - 1, **zeros) if q > 1 else None
        advance(index, torch.zeros(1, **zeros), token_ids, drafts, torch.zeros(q, **zeros), torch.zeros(q, **zeros),
                torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, 1, dtype=torch.int32, device=device),
                torch.zeros(q, **zeros), block_size)


@triton.jit(do_not_specialize=["num_seqs", "num_rows", "stride_rows", "stride_token", "pad_stride"])
def _draft_starts_kernel(
    rows_ptr, stride_rows, accepted_ptr, token_ptr, stride_token, last_ptr, next_ptr,
    num_seqs, num_rows, pad_stride,
    HAS_SAMPLED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    i = tl.arange(0, BLOCK)
    real = i < num_seqs
    base = tl.load(rows_ptr + i, mask=real, other=0)
    src = tl.load(rows_ptr + stride_rows + i, mask=real, other=-1)
    token = tl.load(rows_ptr + 2 * stride_rows + i, mask=real, other=0)
    last = base
    if HAS_SAMPLED:
        sampling = src >= 0
        accepted = tl.load(accepted_ptr + src, mask=sampling, other=0).to(tl.int64)
        last = base + accepted
        token = tl.where(sampling, tl.load(token_ptr + src * stride_token + accepted, mask=sampling, other=0), token)
    last = tl.where(real, last, i.to(tl.int64) * pad_stride)
    out = i < num_rows
    tl.store(last_ptr + i, last, mask=out)
    tl.store(next_ptr + i, tl.where(real, token, 0), mask=out)


def draft_starts(rows: torch.Tensor, num_accepted: torch.Tensor | None, token_ids: torch.Tensor | None,
                 last_rows: torch.Tensor, next_tokens: torch.Tensor, pad_stride: int) -> None:
    """atom_like.engine.step_inputs.draft_starts in one launch (same arguments, same result)."""
    check_tensor("rows", rows, 2, (torch.int64,))
    check_tensor("last_rows", last_rows, 1, (torch.int64,))
    check_tensor("next_tokens", next_tokens, 1, (torch.int64,))
    check_same_device(rows=rows, last_rows=last_rows, next_tokens=next_tokens)
    if rows.shape[0] != 3 or rows.shape[1] > last_rows.shape[0] or next_tokens.shape != last_rows.shape:
        raise ValueError(f"rows {tuple(rows.shape)}, last_rows {tuple(last_rows.shape)}, next_tokens "
                         f"{tuple(next_tokens.shape)}: expected rows [3, B] and two outputs of one length >= B")
    sampled = num_accepted is not None and num_accepted.numel() > 0
    if sampled:
        check_tensor("num_accepted", num_accepted, 1, (torch.int64,))
        check_tensor("token_ids", token_ids, 2, (torch.int64,))
    n = last_rows.shape[0]
    _draft_starts_kernel[(1,)](
        rows, rows.stride(0), num_accepted if sampled else rows, token_ids if sampled else rows,
        token_ids.stride(0) if sampled else 0, last_rows, next_tokens, rows.shape[1], n, pad_stride,
        HAS_SAMPLED=sampled, BLOCK=triton.next_power_of_2(max(n, 16)), **pdl.launch_args(rows.device),
    )
