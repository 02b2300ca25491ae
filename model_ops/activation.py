"""SwiGLU on a merged [gate | up] projection. On a GPU it runs as one Triton kernel from
kernels_rocm (eagerly it is four kernels and two temporaries); CPU keeps the eager version, the
reference, so CPU results are unchanged."""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F


@functools.cache
def fused_kernels() -> ModuleType | None:
    """kernels_rocm.activation where triton is installed (None: eager everywhere)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from kernels_rocm import activation

    return activation


def _kernel_for(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if x.device.type == "cpu" or x.dim() != 2:
        return None
    kernels = fused_kernels()
    return None if kernels is None else kernels.silu_and_mul


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim."""
    kernel = _kernel_for(x)
    if kernel is not None:
        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
