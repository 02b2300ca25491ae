"""All-reduce, residual add and RMSNorm in one kernel, over peer-mapped memory (one host, NVLink).

A tensor-parallel decoder layer ends its attention and its MLP with a row-parallel projection
whose partial sums are all-reduced, and the result goes straight into a residual add and an
RMSNorm. Done apart that is a one-shot all-reduce kernel (two cross-GPU barriers inside) and a
norm kernel; here every program owns one row and does all of it, and the exchange is one
one-way trip over the link:

1. wait for the kernel before (PDL); the row's call counter (in this rank's memory; every rank
   makes the same calls, so the counters agree) picks one of two slots;
2. push: store its partial row straight into every peer's staging buffer (slot, this rank's
   part, row), with no flag and no fence: an element whose bits are all ones is "not arrived",
   and every slot holds all ones between uses, so the values themselves say when they are
   there (a partial sum that happens to be all ones, a NaN, is sent as another NaN);
3. poll its own buffer (local memory) until none of each peer's elements is all ones, put all
   ones back (the slot is then ready for its next use), add the rows in rank order in fp32,
   round once to the activation dtype (two ranks: the bits NCCL and the one-shot kernel
   produce), then residual add and RMSNorm exactly as kernels_rocm.rms_norm rounds them.

Why this is safe without flags: each element is checked on its own, so it does not matter in
which order a peer's stores land. A rank pushes into slot s again two calls later, after it has
seen every peer's row of the call in between, which each peer pushes only after its kernel of
the call before (the one that read and cleared slot s) has finished: stream order. Against the
previous (pull) form, which signalled through a system-scope release and then read the peer's
row across the link, this drops a fence and a round trip a call (docs/benchmarks.md section 9).

Programs spin, so all of a launch's rows must be resident at once: the caller keeps the grid
within one wave (rows <= SMs). A wait that outlives `SPIN_LIMIT` polls (a peer that died) gives
up, counts itself in `errors` and produces garbage rather than hanging the GPU forever; the
caller checks `errors` in tests.

CUDA only (peer memory through torch symmetric memory); ROCm keeps RCCL and the separate norm
(aiter's fused all-reduce + RMSNorm is not wired; docs/rocm.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import SUPPORTED_DTYPES, check_same_device, check_tensor
from kernels_rocm.rms_norm import rms_scale

SPIN_LIMIT = 1 << 26  # polls of a row (~ seconds) before a wait gives up
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}  # the staging's views
# a NaN that is not all ones, sent in place of the all-ones NaN ("not arrived")
OTHER_NAN = {torch.int16: 0x7FC0, torch.int32: 0x7FC00000}


@triton.jit
def _allreduce_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, bufs, counter_ptr, errors_ptr,
    stride_x: tl.int64, stride_residual: tl.int64, stride_out: tl.int64, hidden, eps, max_rows, pitch,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, OTHER_NAN: tl.constexpr,
    SPIN_LIMIT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    slot = tl.load(counter_ptr + row) & 1
    tl.store(counter_ptr + row, slot ^ 1)
    dtype = x_ptr.dtype.element_ty
    bits = bufs[0].dtype.element_ty
    mine = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    sent = mine.to(bits, bitcast=True)
    sent = tl.where(sent == -1, tl.full([BLOCK], OTHER_NAN, bits), sent)
    for peer in tl.static_range(WORLD):
        if peer != RANK:  # peer's buffer, slot, the part from RANK
            tl.store(bufs[peer] + ((slot * WORLD + RANK) * max_rows + row).to(tl.int64) * pitch + offs, sent,
                     mask=mask)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):  # rank order: every rank adds the same way
        if peer == RANK:
            acc += mine.to(tl.float32)
        else:
            part = bufs[RANK] + ((slot * WORLD + peer) * max_rows + row).to(tl.int64) * pitch + offs
            got = tl.load(part, mask=mask, other=0, volatile=True)
            polls = 0
            while (tl.max((got == -1).to(tl.int32), axis=0) > 0) & (polls < SPIN_LIMIT):
                got = tl.load(part, mask=mask, other=0, volatile=True)
                polls += 1
            if polls >= SPIN_LIMIT:
                tl.atomic_add(errors_ptr, 1)
            tl.store(part, tl.full([BLOCK], -1, bits), mask=mask)  # not arrived, for the slot's next use
            acc += got.to(dtype, bitcast=True).to(tl.float32)
    residual_row = residual_ptr + row.to(tl.int64) * stride_residual + offs
    h = (acc.to(dtype).to(tl.float32) + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(residual_row, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, rms_scale(h, rstd, weight, dtype), mask=mask)


def allreduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           bufs: tuple[torch.Tensor, ...], counters: torch.Tensor, errors: torch.Tensor,
                           rank: int) -> torch.Tensor:
    """out = weight * rms_normalize(residual <- sum over ranks of x + residual), residual updated in
    place, for x / residual [T, H]. `bufs[r]`: rank r's staging buffer as this process maps it (its
    own at `rank`), integers of x's width (`BITS[x.dtype]`), all ones (-1) on every rank before the
    first call, laid out as 2 slots x ranks x rows x a row pitch of at least H (the pitch follows
    from the size, so calls of any width share one buffer); `counters` [rows] int32 and `errors`
    [1] int32 are this rank's, zero at start. Every rank calls it with the same shapes in the same
    order."""
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
    pitch = bufs[0].numel() // max(2 * world * max_rows, 1)
    if rows > max_rows or hidden > pitch or any(b.numel() != bufs[0].numel() for b in bufs):
        raise ValueError(f"{rows} rows of {hidden}: the staging buffers hold 2 x {world} x {max_rows} rows of "
                         f"{pitch} for {world} ranks")
    if any(b.dtype != BITS[x.dtype] for b in bufs):
        raise ValueError(f"staging buffers of {bufs[0].dtype} for {x.dtype} rows: view them as {BITS[x.dtype]}")
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(hidden)
        _allreduce_rms_norm_kernel[(rows,)](
            x, residual, weight, out, tuple(bufs), counters, errors,
            x.stride(0), residual.stride(0), out.stride(0), hidden, eps, max_rows, pitch,
            RANK=rank, WORLD=world, BLOCK=block, OTHER_NAN=OTHER_NAN[BITS[x.dtype]], SPIN_LIMIT=SPIN_LIMIT,
            num_warps=min(16, max(1, block // 512)), **pdl.launch_args(x.device),
        )
    return out
