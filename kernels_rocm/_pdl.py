"""Programmatic dependent launch (PDL) for the decode-path kernels, on NVIDIA sm_90 and later.

A decode step replays a CUDA graph of ~320 kernels, most of them a few microseconds long; between
two of them the GPU sits ~0.6 us idle while the next grid is launched (docs/benchmarks.md
section 8: 3.7% of a Llama-3.1-8B step at batch 1). A kernel launched with PDL may be scheduled
while the kernel before it is still running: its programs start, then wait in
`griddepcontrol.wait` until that kernel has finished and its writes are visible, so the launch
overlaps the previous kernel's tail instead of following it.

Every kernel taking part calls `wait_for_previous_kernel` first, before any load or store (a
store could race a read of the kernel before; a load could see stale data), and only then lets
its own dependents launch: one kernel at most waits ahead, so waiting programs never crowd out
running ones. Kernels without PDL (torch's, cuBLAS, NCCL) neither trigger nor are triggered
early, so mixing them is always safe.

Measured on an H100 (docs/benchmarks.md section 8, Llama-3.1-8B shape, batch 1, same run): GPU
idle 3.2% -> 1.5% of the step under the profiler, step 5.58 -> 5.42 ms.

Off on ROCm (no equivalent in Triton's HIP backend), under the CPU interpreter, and before sm_90;
`set_enabled(False)` turns it off for A/B measurements (graphs captured afterwards launch plainly).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_rocm._util import INTERPRET, IS_HIP

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without its NVIDIA backend: PDL stays off, the branch below is never compiled
    gdc_launch_dependents = gdc_wait = None

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Launch with PDL where supported (the default) or never; affects launches (and graph
    captures) from now on."""
    global _enabled
    _enabled = enabled


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch on `device`: the kernel's `PDL` constexpr and, when on,
    Triton's `launch_pdl` option (the launch attribute)."""
    on = (_enabled and gdc_wait is not None and not INTERPRET and not IS_HIP and device.type == "cuda"
          and _supported(device.index if device.index is not None else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """First statement of a PDL kernel: wait until the kernel before has finished (a no-op when
    it was launched without PDL), then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
