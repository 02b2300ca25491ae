"""kernels_rocm.allreduce_rms_norm in the interpreter, as rank 0 of 2 (or 1 of 3) whose peers have
already arrived: their rows staged in their buffers' slot for the call and their flags raised in
this rank's flags, so the kernel's wait passes at once. Checks the sum in rank order, the residual
add and RMSNorm against the separate kernels, the slot alternation and the per-row call counters
over several calls of different row counts, the signals it leaves in the peers' flags, and that a
peer that never arrives ends the wait (counted in `errors`) instead of hanging. The cross-GPU
behaviour (NVLink, system-scope atomics) is tests/gpu/test_tp_gpu.py's."""
from __future__ import annotations

import pytest
import torch

import kernels_rocm.allreduce_rms_norm as mod
from kernels_rocm.rms_norm import fused_add_rms_norm

MAX_ROWS, HIDDEN = 4, 96


def _setup(world: int):
    bufs = tuple(torch.full((2 * MAX_ROWS * HIDDEN,), float("nan")) for _ in range(world))
    flags = tuple(torch.zeros(world * MAX_ROWS, dtype=torch.int32) for _ in range(world))
    return bufs, flags, torch.zeros(MAX_ROWS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)


@pytest.mark.parametrize("world, rank", [(2, 0), (3, 1)])
def test_sums_in_rank_order_then_adds_and_normalizes(world, rank):
    bufs, flags, counters, errors = _setup(world)
    g = torch.Generator().manual_seed(world)
    weight = torch.randn(HIDDEN, generator=g)
    for call, rows in enumerate([3, 1, 4, 2], start=1):  # rows past a call's count keep their counters
        parts = [torch.randn(rows, HIDDEN, generator=g) for _ in range(world)]
        for peer in range(world):
            if peer != rank:  # the peer arrived: its rows in this call's slot, its flags raised here
                epoch = counters[:rows] + 1
                slot = bufs[peer].view(2, MAX_ROWS, HIDDEN)
                for row in range(rows):
                    slot[int(epoch[row]) % 2, row] = parts[peer][row]
                flags[rank].view(world, MAX_ROWS)[peer, :rows] = epoch
        residual = torch.randn(rows, HIDDEN, generator=g)
        ref_residual = residual.clone()
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        ref, _ = fused_add_rms_norm(total, ref_residual, weight, 1e-6)
        out = mod.allreduce_add_rms_norm(parts[rank], residual, weight, 1e-6, bufs, flags, counters, errors, rank)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(residual, ref_residual, rtol=1e-6, atol=1e-6)
        for peer in range(world):  # this rank's signal of the call is in every peer's flags
            if peer != rank:
                assert flags[peer].view(world, MAX_ROWS)[rank, :rows].tolist() == counters[:rows].tolist()
    assert counters.tolist() == [4, 3, 2, 1] and errors.item() == 0  # row r ran in every call of > r rows


def test_call_counters_wrap_without_losing_a_call():
    """After EPOCHS calls a row's counter wraps to 0 (an int32 never overflows, days of serving):
    the peers' signals compare as serial numbers and the slots keep alternating across the wrap."""
    world, rank = 2, 0
    bufs, flags, counters, errors = _setup(world)
    counters.fill_(mod.EPOCHS - 2)
    flags[rank].fill_(mod.EPOCHS - 2)  # the peer's signal of the call before
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(HIDDEN, generator=g)
    for _ in range(4):  # epochs EPOCHS - 1, 0, 1, 2
        epoch = (int(counters[0]) + 1) % mod.EPOCHS
        parts = [torch.randn(2, HIDDEN, generator=g) for _ in range(world)]
        bufs[1].view(2, MAX_ROWS, HIDDEN)[epoch % 2, :2] = parts[1]
        residual = torch.randn(2, HIDDEN, generator=g)
        ref, _ = fused_add_rms_norm(parts[0] + parts[1], residual.clone(), weight, 1e-6)
        stale = flags[rank].view(world, MAX_ROWS)[1, :2].clone()
        with pytest.MonkeyPatch.context() as patch:  # before the peer signals (its flag a call behind), no pass
            patch.setattr(mod, "SPIN_LIMIT", 3)
            mod.allreduce_add_rms_norm(parts[0], residual.clone(), weight, 1e-6, bufs, flags, counters.clone(),
                                       errors, rank)
        assert errors.item() == 2 and torch.equal(flags[rank].view(world, MAX_ROWS)[1, :2], stale)
        errors.zero_()
        flags[rank].view(world, MAX_ROWS)[1, :2] = epoch  # now the peer's row of this call is there
        out = mod.allreduce_add_rms_norm(parts[0], residual, weight, 1e-6, bufs, flags, counters, errors, rank)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        assert counters[:2].tolist() == [epoch] * 2 and errors.item() == 0


def test_a_peer_that_never_arrives_ends_the_wait(monkeypatch):
    monkeypatch.setattr(mod, "SPIN_LIMIT", 3)
    bufs, flags, counters, errors = _setup(2)
    x, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    mod.allreduce_add_rms_norm(x, residual, torch.ones(HIDDEN), 1e-6, bufs, flags, counters, errors, 0)
    assert errors.item() == 2  # both rows gave up


def test_rejects_rows_beyond_the_staging():
    bufs, flags, counters, errors = _setup(2)
    with pytest.raises(ValueError, match="5 rows of 96: the staging buffers hold 2 x 4 rows"):
        mod.allreduce_add_rms_norm(torch.randn(5, HIDDEN), torch.randn(5, HIDDEN), torch.ones(HIDDEN), 1e-6,
                                   bufs, flags, counters, errors, 0)
