"""A greedy step's verification in one kernel: which drafts each sequence keeps and what it emits.

When every row of a step is greedy (model_ops.sampling.verify), a sequence accepts its drafts
while each equals the argmax of the row before it, then emits the argmax of the row after the last
one kept. In torch that is ~16 small kernels a step after the argmax (a gather of the drafts, the
comparison, a cumulative product, the emitted tokens' gathers, the padded token rows), all outside
the decode graphs; a small model's steps are host-bound, so each launch is host time
(docs/benchmarks.md section 11). Here one program per sequence does it.
model_ops.sampling.DraftLayout.verified is the torch version: the CPU path and the oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import check_same_device, check_tensor


@triton.jit(do_not_specialize=["width"])
def _greedy_verify_kernel(
    emitted_ptr, draft_ids_ptr, row_index_ptr, draft_index_ptr, valid_ptr, tokens_ptr, accepted_ptr,
    width, W_PAD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    s = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, W_PAD)
    drafted = j < width
    valid = tl.load(valid_ptr + s * width + j, mask=drafted, other=0) != 0
    draft = tl.load(draft_ids_ptr + tl.load(draft_index_ptr + s * width + j, mask=valid, other=0), mask=valid, other=-1)
    rows = tl.load(row_index_ptr + s * (width + 1) + j, mask=j <= width, other=0)
    argmax = tl.load(emitted_ptr + rows, mask=j <= width, other=-2)
    store_verified(tokens_ptr, accepted_ptr, s, j, width, draft, valid & (draft == argmax), argmax, W_PAD)


@triton.jit
def store_verified(tokens_ptr, accepted_ptr, s, j, width, draft, accept, emitted, W_PAD: tl.constexpr):
    """Sequence s's token row and accepted count from its drafts' `accept` flags (False past its
    drafts) and the token each of its rows emits (`emitted`, by j = 0..width): what
    DraftLayout.verified does. The first draft not accepted ends the run."""
    kept = tl.min(tl.where(accept, W_PAD, j), axis=0)
    last = tl.sum(tl.where(j == kept, emitted, 0), axis=0)
    tokens = tl.where(j < kept, draft, tl.where(j == kept, last, -1))
    tl.store(tokens_ptr + s * (width + 1) + j, tokens, mask=j <= width)
    tl.store(accepted_ptr + s, kept.to(tl.int64))


def greedy_verify(emitted: torch.Tensor, draft_ids: torch.Tensor, row_index: torch.Tensor, draft_index: torch.Tensor,
                  valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [S, K + 1], accepted counts [S]) as DraftLayout.verified(emitted, accept) gives them
    for a greedy step (accept: each draft equals its row's argmax), in one launch. emitted [R] int64:
    each row's argmax; draft_ids [D]; row_index [S, K + 1], draft_index / valid [S, K]: the layout."""
    check_tensor("emitted", emitted, 1, (torch.int64,))
    check_tensor("draft_ids", draft_ids, 1, (torch.int64,))
    check_tensor("row_index", row_index, 2, (torch.int64,))
    check_tensor("draft_index", draft_index, 2, (torch.int64,))
    check_same_device(emitted=emitted, draft_ids=draft_ids, row_index=row_index, draft_index=draft_index, valid=valid)
    num_seqs, width = draft_index.shape
    if row_index.shape != (num_seqs, width + 1) or valid.shape != (num_seqs, width) or valid.dtype != torch.bool:
        raise ValueError(f"row_index {tuple(row_index.shape)}, draft_index {tuple(draft_index.shape)}, valid "
                         f"{tuple(valid.shape)} {valid.dtype}: expected [S, K + 1], [S, K] and [S, K] bool")
    tokens = torch.empty(num_seqs, width + 1, dtype=torch.int64, device=emitted.device)
    accepted = torch.empty(num_seqs, dtype=torch.int64, device=emitted.device)
    if num_seqs:
        _greedy_verify_kernel[(num_seqs,)](
            emitted, draft_ids, row_index.contiguous(), draft_index.contiguous(), valid.contiguous().view(torch.int8),
            tokens, accepted, width, W_PAD=triton.next_power_of_2(width + 1), **pdl.launch_args(emitted.device))
    return tokens, accepted


def precompile(device: torch.device, max_drafts: int) -> None:
    """Compile the kernel for every block of draft widths 1..max_drafts (one launch each on scratch
    tensors), so that a step never waits for a compile when its width first appears."""
    zeros = dict(dtype=torch.int64, device=device)
    for width in sorted({triton.next_power_of_2(k + 1) - 1 for k in range(1, max_drafts + 1)}):
        greedy_verify(torch.zeros(width + 1, **zeros), torch.zeros(width, **zeros), torch.zeros(1, width + 1, **zeros),
                      torch.zeros(1, width, **zeros), torch.zeros(1, width, dtype=torch.bool, device=device))
