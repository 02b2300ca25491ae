"""kernels_rocm.allreduce_rms_norm in the interpreter, as rank 0 of 2 (or 1 of 3) whose peers have
already pushed their rows into this rank's staging buffer, so the kernel's wait passes at once.
Checks the sum in rank order, the residual add and RMSNorm against the separate kernels, the slot
alternation over calls of different row counts, the rows it pushes into the peers' buffers (an
all-ones NaN sent as another NaN), that it leaves the parts it read all ones for their next use,
and that a peer that never arrives ends the wait (counted in `errors`) instead of hanging. The
cross-GPU behaviour (NVLink, the stores landing in any order) is tests/gpu/test_tp_gpu.py's."""
from __future__ import annotations

import pytest
import torch

import kernels_rocm.allreduce_rms_norm as mod
from kernels_rocm.rms_norm import fused_add_rms_norm

MAX_ROWS, HIDDEN, PITCH = 4, 96, 128  # a row pitch above the hidden size, as a buffer sized for larger models


def _setup(world: int):
    bufs = tuple(torch.full((2 * world * MAX_ROWS * PITCH,), -1, dtype=torch.int32) for _ in range(world))
    return bufs, torch.zeros(MAX_ROWS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)


def _part(buf: torch.Tensor, world: int, slot: int, sender: int, row: int) -> torch.Tensor:
    return buf.view(2, world, MAX_ROWS, PITCH)[slot, sender, row, :HIDDEN]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("world, rank", [(2, 0), (3, 1)])
def test_sums_in_rank_order_then_adds_and_normalizes(world, rank):
    bufs, counters, errors = _setup(world)
    g = torch.Generator().manual_seed(world)
    weight = torch.randn(HIDDEN, generator=g)
    calls = [0] * MAX_ROWS
    for rows in [3, 1, 4, 2]:  # rows past a call's count keep their slots
        parts = [torch.randn(rows, HIDDEN, generator=g) for _ in range(world)]
        slots = [calls[row] % 2 for row in range(rows)]
        for peer in range(world):
            if peer != rank:  # the peer arrived: its rows in this rank's buffer, its part of this call's slot
                for row in range(rows):
                    _part(bufs[rank], world, slots[row], peer, row).copy_(_bits(parts[peer][row]))
        residual = torch.randn(rows, HIDDEN, generator=g)
        ref_residual = residual.clone()
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        ref, _ = fused_add_rms_norm(total, ref_residual, weight, 1e-6)
        out = mod.allreduce_add_rms_norm(parts[rank], residual, weight, 1e-6, bufs, counters, errors, rank)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(residual, ref_residual, rtol=1e-6, atol=1e-6)
        for row in range(rows):
            for peer in range(world):
                if peer != rank:  # this rank's row pushed to the peer; the peer's part here cleared
                    assert torch.equal(_part(bufs[peer], world, slots[row], rank, row), _bits(parts[rank][row]))
                    assert (_part(bufs[rank], world, slots[row], peer, row) == -1).all()
            calls[row] += 1
    assert counters.tolist() == [c % 2 for c in calls] == [0, 1, 0, 1] and errors.item() == 0
    # nothing was written past a row's hidden size (the pitch's tail) nor into this rank's own parts
    own = bufs[rank].view(2, world, MAX_ROWS, PITCH)
    assert (own[..., HIDDEN:] == -1).all() and (own[:, rank] == -1).all()


def test_an_all_ones_nan_is_sent_as_another_nan():
    """All ones means "not arrived": a partial sum with those bits (a NaN) must not look unsent."""
    world, rank = 2, 0
    bufs, counters, errors = _setup(world)
    x = torch.randn(1, HIDDEN)
    x.view(torch.int32)[0, 5] = -1
    _part(bufs[rank], world, 0, 1, 0).copy_(_bits(torch.randn(HIDDEN)))
    out = mod.allreduce_add_rms_norm(x, torch.randn(1, HIDDEN), torch.ones(HIDDEN), 1e-6, bufs, counters, errors, rank)
    pushed = _part(bufs[1], world, 0, rank, 0)
    assert pushed[5].item() == mod.OTHER_NAN[torch.int32] and torch.equal(pushed[:5], _bits(x[0, :5]))
    assert torch.isnan(out).all() and errors.item() == 0  # the NaN reached the sum (and the norm)


def test_a_peer_that_never_arrives_ends_the_wait(monkeypatch):
    monkeypatch.setattr(mod, "SPIN_LIMIT", 3)
    bufs, counters, errors = _setup(2)
    _part(bufs[0], 2, 0, 1, 0).copy_(_bits(torch.randn(HIDDEN)))  # row 0 arrived whole; row 1 lacks one element
    part = _part(bufs[0], 2, 0, 1, 1)
    part.copy_(_bits(torch.randn(HIDDEN)))
    part[HIDDEN - 1] = -1
    x, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    mod.allreduce_add_rms_norm(x, residual, torch.ones(HIDDEN), 1e-6, bufs, counters, errors, 0)
    assert errors.item() == 1  # row 1 gave up


def test_rejects_rows_beyond_the_staging_and_a_wrong_view():
    bufs, counters, errors = _setup(2)
    with pytest.raises(ValueError, match="5 rows of 96: the staging buffers hold 2 x 2 x 4 rows of 128"):
        mod.allreduce_add_rms_norm(torch.randn(5, HIDDEN), torch.randn(5, HIDDEN), torch.ones(HIDDEN), 1e-6,
                                   bufs, counters, errors, 0)
    with pytest.raises(ValueError, match="view them as torch.int16"):
        x = torch.randn(2, HIDDEN).bfloat16()
        mod.allreduce_add_rms_norm(x, x.clone(), torch.ones(HIDDEN), 1e-6, bufs, counters, errors, 0)
