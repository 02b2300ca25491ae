"""What a stage boundary costs: a chain of dependent GEMVs as one launch a stage (programmatic dependent launch,
as the engine's decode step runs its ~17 kernels a layer) against one persistent launch whose programs meet at a
grid barrier between stages (issue 21: the c1 Kimi step is bound by its chain of dependent launches;
docs/benchmarks.md section 10, "What a stage boundary costs").

Each stage is y = W x over a square bf16 W [D, D] (its own weights: nothing reused from L2), the next stage's x is
this y. Same GEMV code in both forms (8 rows a program-step, fp32 sums): the launches take D / 8 programs a stage;
the persistent kernel 1, 2 or 4 programs an SM (those that fit at once), each walking its share of the row blocks,
then a barrier (an atomic counter and a spin on it, acquire / release at GPU scope). Also timed: the persistent
kernel without its barriers (wrong results: the bound a boundary-free chain could reach), and with each program's
first weight tile of the next stage loaded before it waits at the barrier (written after the
first measurements, not yet run on a GPU). CUDA graphs, L2 emptied by reads between replays (ci/gpu_timing),
medians; outputs checked against torch (fp32 on the same bf16 inputs). GPU only: the barrier spins until every
program has arrived, which the CPU interpreter, running programs one after another, never lets happen.

    python ci/bench_grid_barrier.py [--out DIR]      (writes DIR/bench_grid_barrier.json; ci/gpu_check.sh grid_barrier)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402
from kernels_rocm import _pdl as pdl  # noqa: E402
from kernels_rocm._pdl import wait_for_previous_kernel  # noqa: E402

ROWS, BLOCK_K = 8, 512


@triton.jit
def _gemv_rows(w_ptr, x_ptr, y_ptr, block, D, first_w, HAS_FIRST: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """y[rows of `block`] = W[rows] @ x, fp32 sums; x read past L1 (.cg): another SM wrote it. With HAS_FIRST,
    `first_w` is W's first K tile of these rows, loaded earlier by the caller."""
    rows = block * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
    start = 0
    if HAS_FIRST:
        x = tl.load(x_ptr + tl.arange(0, BLOCK_K), cache_modifier=".cg")
        acc += first_w.to(tl.float32) * x.to(tl.float32)[None, :]
        start = BLOCK_K
    for k0 in range(start, D, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :])
        x = tl.load(x_ptr + cols, cache_modifier=".cg")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))


@triton.jit
def _first_tile(w_ptr, block, D, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """W's first K tile of `block`'s rows (weights: nothing a stage writes, so it may be read ahead)."""
    rows = block * ROWS + tl.arange(0, ROWS)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * D + tl.arange(0, BLOCK_K)[None, :])


@triton.jit
def _stage_kernel(w_ptr, x_ptr, y_ptr, D, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One stage as its own launch: a row block a program."""
    wait_for_previous_kernel(PDL)
    _gemv_rows(w_ptr, x_ptr, y_ptr, tl.program_id(0), D, w_ptr, False, ROWS, BLOCK_K)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Wait until `target` arrivals: this program's stores are done (CTA barrier) and released with its
    arrival; the spin's acquire makes the other programs' stores visible."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(w_ptr, xs_ptr, counter_ptr, D, STAGES: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_K: tl.constexpr, BARRIER: tl.constexpr, PREFETCH: tl.constexpr):
    """Every stage in one launch: program p takes row blocks p, p + P, ...; a grid barrier between stages.
    xs [STAGES + 1, D]: stage s reads row s, writes row s + 1. Without BARRIER (timing only: the stages
    then read inputs not yet written) the same work with nothing between the stages. With PREFETCH each
    program loads the next stage's first weight tile of its first row block before it waits at the
    barrier, so that those bytes are on their way while the slowest program finishes (stages overlapping
    in their weight reads: issue 21's open question; not yet run on a GPU)."""
    programs = tl.num_programs(0)
    pid = tl.program_id(0)
    first_w = _first_tile(w_ptr, pid % (D // ROWS), D, ROWS, BLOCK_K)
    for stage in range(STAGES):
        w = w_ptr + stage.to(tl.int64) * D * D
        for block in range(pid, D // ROWS, programs):
            if PREFETCH:
                if block == pid:
                    _gemv_rows(w, xs_ptr + stage * D, xs_ptr + (stage + 1) * D, block, D, first_w, True, ROWS,
                               BLOCK_K)
                else:
                    _gemv_rows(w, xs_ptr + stage * D, xs_ptr + (stage + 1) * D, block, D, first_w, False, ROWS,
                               BLOCK_K)
            else:
                _gemv_rows(w, xs_ptr + stage * D, xs_ptr + (stage + 1) * D, block, D, first_w, False, ROWS,
                           BLOCK_K)
        if PREFETCH:  # the next stage's first tile (past the last stage: stage 0's again, unused)
            first_w = _first_tile(w_ptr + ((stage + 1) % STAGES).to(tl.int64) * D * D, pid % (D // ROWS), D,
                                  ROWS, BLOCK_K)
        if BARRIER:
            _grid_barrier(counter_ptr, (stage + 1) * programs)


def run_launches(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    stages, d, _ = w.shape
    for s in range(stages):
        _stage_kernel[(d // ROWS,)](w[s], xs[s], xs[s + 1], d, ROWS=ROWS, BLOCK_K=BLOCK_K, num_warps=4,
                                    **pdl.launch_args(w.device))
    return xs[-1]


def run_persistent(w: torch.Tensor, xs: torch.Tensor, counter: torch.Tensor, programs: int,
                   barrier: bool = True, prefetch: bool = False) -> torch.Tensor:
    stages, d, _ = w.shape
    counter.zero_()
    _persistent_kernel[(programs,)](w, xs, counter, d, STAGES=stages, ROWS=ROWS, BLOCK_K=BLOCK_K, BARRIER=barrier,
                                    PREFETCH=prefetch, num_warps=4)
    return xs[-1]


def resident_programs(w: torch.Tensor, xs: torch.Tensor, counter: torch.Tensor, prefetch: bool) -> int:
    """How many programs of the persistent kernel fit the GPU at once, by registers (its shared memory is
    1 KB): a barrier deadlocks unless every program is resident."""
    stages, d, _ = w.shape
    kernel = _persistent_kernel.warmup(w, xs, counter, d, STAGES=stages, ROWS=ROWS, BLOCK_K=BLOCK_K, BARRIER=True,
                                       PREFETCH=prefetch, num_warps=4, grid=(1,))
    kernel.run  # loads the binary: Triton sets n_regs then
    props = torch.cuda.get_device_properties(w.device)
    return props.multi_processor_count * (props.regs_per_multiprocessor // (kernel.n_regs * 32 * 4))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--stages", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_grid_barrier: needs a CUDA GPU", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = dict(device=torch.cuda.get_device_name(), sms=sms, copy=measure_copy_bandwidth(), rows=[])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d in (1536, 4096, 7168):
        w = (torch.randn(args.stages, d, d, generator=gen, device="cuda") * d**-0.5).bfloat16()
        xs = torch.zeros(args.stages + 1, d, dtype=torch.bfloat16, device="cuda")
        xs[0] = torch.randn(d, generator=gen, device="cuda").bfloat16()
        ref = xs[0].float()
        for s in range(args.stages):
            ref = (w[s].float() @ ref).bfloat16().float()
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        launches_ms = time_graph(lambda: run_launches(w, xs))
        err_launches = rel_error(run_launches(w, xs).float(), ref)
        row = dict(d=d, stage_mb=d * d * 2 / 1e6, launches_us_per_stage=launches_ms * 1e3 / args.stages,
                   err_launches=err_launches)
        fits = {p: resident_programs(w, xs, counter, p) for p in (False, True)}
        for programs in (sms, 2 * sms, 4 * sms):
            if programs > min(fits.values()):  # a program not resident would never reach the barrier
                continue
            ms = time_graph(lambda: run_persistent(w, xs, counter, programs))
            row[f"persistent_{programs}_us_per_stage"] = ms * 1e3 / args.stages
            row[f"err_persistent_{programs}"] = rel_error(run_persistent(w, xs, counter, programs).float(), ref)
            ms = time_graph(lambda: run_persistent(w, xs, counter, programs, barrier=False))
            row[f"no_barrier_{programs}_us_per_stage"] = ms * 1e3 / args.stages
            ms = time_graph(lambda: run_persistent(w, xs, counter, programs, prefetch=True))
            row[f"prefetch_{programs}_us_per_stage"] = ms * 1e3 / args.stages
            row[f"err_prefetch_{programs}"] = rel_error(
                run_persistent(w, xs, counter, programs, prefetch=True).float(), ref)
        copy_us = d * d * 2 / result["copy"]["gbps"] / 1e3
        row["copy_us_per_stage"] = copy_us
        result["rows"].append(row)
        print(f"D={d} ({row['stage_mb']:.1f} MB a stage, {copy_us:.2f} us at copy bandwidth): "
              f"launches {row['launches_us_per_stage']:.2f} us a stage, persistent "
              + ", ".join(f"{p} programs {row[f'persistent_{p}_us_per_stage']:.2f} us "
                          f"({row[f'no_barrier_{p}_us_per_stage']:.2f} without barriers, "
                          f"{row[f'prefetch_{p}_us_per_stage']:.2f} prefetching)"
                          for p in (sms, 2 * sms, 4 * sms) if f"persistent_{p}_us_per_stage" in row)
              + f"; errors {err_launches:.1e} / {row[f'err_persistent_{sms}']:.1e}", flush=True)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_grid_barrier.json").write_text(json.dumps(result, indent=1))
    bad = [r for r in result["rows"] for k, v in r.items() if k.startswith("err") and not v < 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
