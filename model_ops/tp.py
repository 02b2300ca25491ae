"""Tensor parallelism: this process's place in the tensor-parallel group, its collectives, and
how a sharded parameter says which part of a checkpoint tensor it holds.

One process per rank (atom_like.engine.tp_executor starts them and sets the state here once).
Layers read `rank()` / `size()` when they are built to decide which slice of each weight they
own, and call `all_reduce` / `all_gather` in forward. With size 1 (the default: nothing ever
set it) every collective is the identity and every slice is the whole tensor, so
single-process code paths, and the CPU exactness tests built on them, do not change.

Collectives are torch.distributed's on the group given (NCCL on CUDA, RCCL on ROCm, gloo on
CPU); they run on the current stream, so decode graphs capture them like any kernel. On NVIDIA
GPUs of one host, small all-reduces (decode's activations) take a one-shot kernel over peer
memory instead (OneShotAllReduce below), unless --disable-custom-all-reduce.

Benchmark only: a `simulated` state is rank r of N with no peers (ci/bench_kimi.py runs one
TP8 rank of Kimi-K2.5 on one GPU). Its collectives move nothing and cost nothing: all_reduce
returns this rank's partial sum as it is, all_gather returns a tensor of the gathered shape
holding this rank's part N times over. Shapes, kernels and bytes read are those of the real
rank; values are not those of any real model, and the collectives' time is left out (the bench
estimates it on paper). Never set by the engine; only `tp_state(..., simulated=True)` sets it.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

# torch >= 2.12 renames all_gather_into_tensor to all_gather_single; the GPU machines run older
# torches that only have the former, which newer ones still accept.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None with size > 1: layers can be built, not run (pre-spawn checks)
    device: torch.device = torch.device("cpu")  # where collectives' scratch tensors live
    simulated: bool = False  # benchmark only: rank `rank` of `size` without peers, collectives skipped (see above)
    one_shot: OneShotAllReduce | None = None  # small all-reduces over peer memory (CUDA, one host); None: all NCCL


_state = TPState()


def state() -> TPState:
    return _state


def rank() -> int:
    return _state.rank


def size() -> int:
    return _state.size


def set_state(new: TPState) -> None:
    """Set once per process by the worker that owns this rank."""
    global _state
    if not 0 <= new.rank < new.size:
        raise ValueError(f"tensor-parallel rank {new.rank} outside [0, {new.size})")
    if new.simulated and new.group is not None:
        raise ValueError("a simulated tensor-parallel rank has no process group: its collectives are skipped")
    _state = new


@contextlib.contextmanager
def tp_state(rank_: int, size_: int, group: dist.ProcessGroup | None = None,
             simulated: bool = False) -> Iterator[None]:
    """Temporarily act as rank `rank_` of `size_` (building a model skeleton on the meta device
    to check a -tp before any process starts; tests of the slicing). `simulated` (benchmarks
    only): the model built and run inside is rank `rank_` alone, its collectives skipped."""
    old = _state
    set_state(TPState(rank_, size_, group, old.device, simulated))
    try:
        yield
    finally:
        set_state(old)


# ----------------------------------------------------------------------------- collectives

def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks; the identity at size 1 (and on a simulated rank: its partial sum). Use the
    result: NCCL and gloo sum in place, the one-shot kernel into a new tensor."""
    if _state.size == 1 or _state.simulated:
        return x
    if _state.one_shot is not None and _state.one_shot.accepts(x):
        return _state.one_shot(x)
    dist.all_reduce(x, group=_state.group)
    return x


ONE_SHOT_MAX_BYTES = 1 << 20  # decode's all-reduces: batch x hidden x 2 B is 512 KB at batch 64, hidden 4096
FUSED_MAX_ROWS = 128  # the fused all-reduce + RMSNorm's rows a launch (capped by the SM count)
FUSED_MAX_HIDDEN = 8192  # and its hidden size: staging of 2 x ranks x 128 x 8192 fp32 values, 16 MiB a rank at -tp 2


def fused_add_rms_norm_for(x: torch.Tensor) -> OneShotAllReduce | None:
    """The peer-memory all-reduce that can also do the residual add and RMSNorm after it for x (a
    row-parallel layer's partial sums), or None: the caller all-reduces, then adds and norms."""
    one_shot = _state.one_shot
    if _state.size == 1 or _state.simulated or one_shot is None or not one_shot.accepts_rows(x):
        return None
    return one_shot


class OneShotAllReduce:
    """The sum of a small tensor over the ranks of one host in one kernel (torch symmetric memory,
    `symm_mem::one_shot_all_reduce_copy`): each rank copies its input into its own peer-mapped
    buffer; after a device-side barrier every rank reads every rank's buffer directly (NVLink)
    and adds them; a second barrier frees the buffers for the next call. No host involvement, so
    CUDA graphs capture it like any kernel.

    Why: a decode step all-reduces [batch, hidden] twice a layer, a few KB at batch 1, where NCCL
    takes 11.9 us a call on two H200s against 6.7 here (8 KiB, docs/benchmarks.md section 9); the
    8B model's 66 collectives a step took 1.1 ms with NCCL, a third of its -tp 2 step. The one-shot exchange is the custom all-reduce of vLLM and
    SGLang (aiter's on ROCm). Two ranks add in the same order as NCCL (a + b, then rounded), so
    -tp 2 results are the same bits either way; larger tensors keep NCCL, which moves fewer bytes.

    `add_rms_norm` also fuses the residual add and RMSNorm that follow a decoder layer's
    all-reduces into the exchange (kernels_rocm.allreduce_rms_norm: one kernel, each rank's rows
    pushed into double-buffered staging of every peer's, 3.4 us a call at 8 KiB on two H200s);
    `fused_norm=False` (--no-fuse-all-reduce-norm) leaves it out.

    CUDA only: on ROCm torch's symmetric memory is not used here and RCCL sums everything
    (aiter's custom all-reduce is not wired; docs/rocm.md)."""

    DTYPES = (torch.bfloat16, torch.float32)  # what the torch kernel dispatches

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES,
                 fused_norm: bool = True):
        from torch.distributed import _symmetric_memory as symm_mem

        from kernels_rocm._util import num_compute_units

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        # collective: every rank maps every peer's buffer now, at start-up, never inside a capture
        symm_mem.rendezvous(self.buffer, self.group_name)
        # the fused all-reduce + add + RMSNorm (kernels_rocm.allreduce_rms_norm): its own staging
        # buffer (2 slots of every rank's FUSED_MAX_ROWS rows), all ones ("not arrived") on every rank
        # before any use
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # a launch's rows must all be resident at once (they spin); 0: the fused path is off
        self.fused_rows = min(FUSED_MAX_ROWS, num_compute_units(device)) if fused_norm else 0
        if not self.fused_rows:  # --no-fuse-all-reduce-norm: no staging (the same on every rank)
            return
        self.fused_staging = symm_mem.empty(2 * self.world * FUSED_MAX_ROWS * FUSED_MAX_HIDDEN * 4,
                                            dtype=torch.uint8, device=device)
        self.fused_staging.fill_(255)
        self._staging = symm_mem.rendezvous(self.fused_staging, self.group_name)
        self._views: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}  # every rank's staging, as integers of a width
        self.counters = torch.zeros(FUSED_MAX_ROWS, dtype=torch.int32, device=device)
        self.errors = torch.zeros(1, dtype=torch.int32, device=device)  # waits that gave up (a dead peer)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's staging is all ones before any rank pushes

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in self.DTYPES and x.is_cuda and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % 16 == 0 and x.data_ptr() % 16 == 0)  # the kernel's 16-byte vector loads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer.view(x.dtype)[: x.numel()].view(x.shape)  # torch 2.11 wants the input's shape here
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)

    def accepts_rows(self, x: torch.Tensor) -> bool:
        """The fused all-reduce + add + RMSNorm takes x [T, H]: decode-sized T (one wave of
        programs), H within the staging rows, 16-bit or fp32."""
        return (x.dim() == 2 and x.dtype in self.DTYPES and x.is_cuda and x.stride(-1) == 1
                and 0 < x.shape[0] <= self.fused_rows and x.shape[1] <= FUSED_MAX_HIDDEN)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_normalize(residual <- all_reduce(x) + residual), residual), one kernel."""
        from kernels_rocm.allreduce_rms_norm import BITS, allreduce_add_rms_norm

        bits = BITS[x.dtype]
        if bits not in self._views:
            n = self.fused_staging.numel() // x.element_size()
            self._views[bits] = tuple(self._staging.get_buffer(r, (n,), bits) for r in range(self.world))
        out = allreduce_add_rms_norm(x, residual, weight, eps, self._views[bits], self.counters, self.errors,
                                     self.rank)
        return out, residual


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank 0 first; the identity at size 1."""
    if _state.size == 1:
        return x
    if _state.simulated:  # the gathered shape, this rank's part in every rank's place
        return torch.cat([x] * _state.size, dim=dim)
    out = x.new_empty((_state.size * x.shape[0], *x.shape[1:]))  # rank blocks along dim 0 (gloo needs this form)
    dist.all_gather_into_tensor(out, x.contiguous(), group=_state.group)
    d = dim % x.dim()
    return out.view(_state.size, *x.shape).movedim(0, d).flatten(d, d + 1)


def agree_min(value: int) -> int:
    """The smallest `value` over ranks (e.g. KV blocks each rank's memory allows)."""
    if _state.size == 1 or _state.simulated:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_state.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.group)
    return int(t.item())


# ----------------------------------------------------------------------------- partitioning

def divide(total: int, what: str) -> int:
    """`total` / size, refusing, by name, a size that does not divide it."""
    if total % _state.size:
        raise ValueError(f"{what} {total} is not divisible by --tensor-parallel-size {_state.size}: "
                         f"pick a -tp that divides it")
    return total // _state.size


def rank_range(total: int, what: str) -> tuple[int, int]:
    """This rank's equal part [start, stop) of `total` elements."""
    per = divide(total, what)
    return _state.rank * per, (_state.rank + 1) * per


@dataclass(frozen=True)
class TPSlice:
    """The part of a checkpoint tensor this rank loads: along `dim`, whose full logical extent is
    `full`, the ranges [start, stop) in logical elements (features, rows), concatenated in order.

    `pack` logical elements share one stored element along `dim` (2 for packed FP4 weights, 32
    for E8M0 block scales) and a range must not cut a `block` of logical elements (32 for MXFP4
    blocks): both belong to the parameter and are set by its layer."""
    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]
    pack: int = 1
    block: int = 1

    @property
    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def stored_index(self, name: str) -> list[tuple[slice, ...]]:
        """One index into the stored checkpoint tensor per range; refuses, naming the parameter,
        a range that cuts a block or a packed element."""
        grain = max(self.pack, self.block)
        index = []
        for start, stop in self.ranges:
            for edge in (start, stop):
                if edge % grain:
                    raise ValueError(
                        f"{name}: --tensor-parallel-size {_state.size} would cut dim {self.dim} ({self.full} elements) "
                        f"at element {edge}, inside a {grain}-element block of this format: pick a -tp whose "
                        f"per-rank part is a multiple of {grain}")
            index.append((slice(None),) * self.dim + (slice(start // self.pack, stop // self.pack),))
        return index


@runtime_checkable
class TPSharded(Protocol):
    """A module whose parameters are (partly) split across tensor-parallel ranks."""

    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice | None:
        """What this rank loads of the checkpoint tensor that fills `param` (local name), or of
        its shard `shard` (ShardedParameters; None: the whole, possibly fused, tensor). None:
        the tensor is replicated, every rank loads all of it."""
