"""All-reduce, residual add and RMSNorm in one kernel, over peer-mapped memory (one host, NVLink).

A tensor-parallel decoder layer ends its attention and its MLP with a row-parallel projection
whose partial sums are all-reduced, and the result goes straight into a residual add and an
RMSNorm. Done apart that is a one-shot all-reduce kernel (two cross-GPU barriers inside) and a
norm kernel; here every program owns one row and does all of it, with one barrier:

1. wait for the kernel before (PDL), bump its own call counter (`epoch`, in this rank's memory;
   every rank makes the same calls, so the counters agree; counted modulo EPOCHS = 2^30 and
   compared as serial numbers, so a server that runs for days never overflows an int32) and
   write its partial row into this rank's buffer, in slot epoch % 2;
2. signal: store `epoch` into its flag on every peer (release, system scope, after a CTA barrier,
   so the row's stores are visible first), then wait until every peer's flag here reaches
   `epoch` (acquire);
3. read every rank's row of that slot (bypassing L1: the same addresses hold another call's
   rows two calls later), add them in rank order in fp32, round once to the activation dtype
   (two ranks: the bits NCCL and the one-shot kernel produce), then residual add and RMSNorm
   exactly as kernels_rocm.rms_norm rounds them.

Why one barrier is enough: a rank writes slot s again two calls later, after it has seen every
peer's signal of the call in between, which each peer sends only after its kernel of the call
before (the one reading slot s) has finished: stream order. Programs spin, so all of a launch's
rows must be resident at once: the caller keeps the grid within one wave (rows <= SMs). A wait
that outlives `SPIN_LIMIT` polls (a peer that died) gives up, counts itself in `errors` and
produces garbage rather than hanging the GPU forever; the caller checks `errors` in tests.

CUDA only (system-scope atomics to peer memory through torch symmetric memory); ROCm keeps RCCL
and the separate norm (aiter's fused all-reduce + RMSNorm is not wired; docs/rocm.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import SUPPORTED_DTYPES, check_same_device, check_tensor
from kernels_rocm.rms_norm import rms_scale

SPIN_LIMIT = 1 << 26  # polls of a flag (~ seconds) before a wait gives up
EPOCHS = 1 << 30  # call counters wrap here (even: the slot parity survives the wrap)


@triton.jit
def _allreduce_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, bufs, flags, counter_ptr, errors_ptr,
    stride_x: tl.int64, stride_residual: tl.int64, stride_out: tl.int64, hidden, eps, max_rows,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    EPOCHS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    epoch = (tl.load(counter_ptr + row) + 1) & (EPOCHS - 1)
    tl.store(counter_ptr + row, epoch)
    dtype = x_ptr.dtype.element_ty
    place = ((epoch % 2) * max_rows + row).to(tl.int64) * hidden + offs  # this row in its slot of every buffer
    mine = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    tl.store(bufs[RANK] + place, mine, mask=mask)
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        if peer != RANK:  # flags[peer][RANK, row]: "RANK's row of call `epoch` is in its buffer"
            tl.atomic_xchg(flags[peer] + RANK * max_rows + row, epoch, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flag = flags[RANK] + peer * max_rows + row
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            polls = 0
            # wait while the peer's last signal is before `epoch`, as serial numbers modulo EPOCHS
            # (a peer is never more than one call ahead or behind)
            behind = (epoch - seen) & (EPOCHS - 1)
            while (behind > 0) & (behind < EPOCHS // 2) & (polls < SPIN_LIMIT):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                behind = (epoch - seen) & (EPOCHS - 1)
                polls += 1
            if polls >= SPIN_LIMIT:
                tl.atomic_add(errors_ptr, 1)
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            acc += mine.to(tl.float32)
        else:
            acc += tl.load(bufs[peer] + place, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    residual_row = residual_ptr + row.to(tl.int64) * stride_residual + offs
    h = (acc.to(dtype).to(tl.float32) + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(residual_row, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, rms_scale(h, rstd, weight, dtype), mask=mask)


def allreduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           bufs: tuple[torch.Tensor, ...], flags: tuple[torch.Tensor, ...], counters: torch.Tensor,
                           errors: torch.Tensor, rank: int) -> torch.Tensor:
    """out = weight * rms_normalize(residual <- sum over ranks of x + residual), residual updated in
    place, for x / residual [T, H]. `bufs[r]` / `flags[r]`: rank r's staging buffer (2 slots of
    `rows` x H in x's dtype) and flags ([ranks, rows] int32) as this process maps them (its own
    at `rank`); `counters` [rows] int32 and `errors` [1] int32 are this rank's, zero at start.
    Every rank calls it with the same shapes in the same order."""
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    check_tensor("residual", residual, 2, (x.dtype,))
    check_tensor("weight", weight, 1, SUPPORTED_DTYPES)
    check_same_device(x=x, residual=residual, weight=weight, counters=counters)
    rows, hidden = x.shape
    world = len(bufs)
    max_rows = counters.shape[0]
    if residual.shape != x.shape or weight.shape[0] != hidden:
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}: "
                         "residual must have x's shape and weight its hidden size")
    if rows > max_rows or any(b.numel() < 2 * max_rows * hidden for b in bufs) or len(flags) != world:
        raise ValueError(f"{rows} rows of {hidden}: the staging buffers hold 2 x {max_rows} rows of "
                         f"{bufs[0].numel() // max(2 * max_rows, 1)} for {world} ranks")
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(hidden)
        _allreduce_rms_norm_kernel[(rows,)](
            x, residual, weight, out, tuple(bufs), tuple(flags), counters, errors,
            x.stride(0), residual.stride(0), out.stride(0), hidden, eps, max_rows,
            RANK=rank, WORLD=world, BLOCK=block, SPIN_LIMIT=SPIN_LIMIT, EPOCHS=EPOCHS,
            num_warps=min(16, max(1, block // 512)), **pdl.launch_args(x.device),
        )
    return out
