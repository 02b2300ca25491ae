"""RMSNorm, computed like transformers' LlamaRMSNorm (fp32 statistics, weight applied in the
input dtype) so bf16 outputs match the reference models bit for bit where possible.

On a GPU the norm (and the residual add before it) runs as one Triton kernel from kernels_rocm
with the same rounding: the eager version is ~8 kernel launches per norm, which at decode sizes
costs more than the arithmetic. CPU keeps the eager version, the reference."""
from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
from torch import nn

from model_ops import tp


@functools.cache
def fused_kernels() -> ModuleType | None:
    """kernels_rocm.rms_norm where it is installed (None: eager everywhere)."""
    if importlib.util.find_spec("kernels_rocm") is None:
        return None
    from kernels_rocm import rms_norm

    return rms_norm


def _kernels_for(x: torch.Tensor) -> ModuleType | None:
    return None if x.device.type == "cpu" else fused_kernels()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernels_for(x)
        if kernels is not None:
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm of (x + residual), and the sum as the new residual stream. The GPU kernel writes
        the sum into `residual` in place: callers pass a residual nothing else reads afterwards."""
        kernels = _kernels_for(x)
        if kernels is not None and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
            return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual

    def reduce_add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """add_forward of the sum of x over the tensor-parallel ranks (x: a row-parallel layer's
        partial sums, not yet all-reduced): one kernel over peer memory where model_ops.tp has
        it (all-reduce, add and norm fused: one cross-GPU barrier, no separate norm launch), else
        the all-reduce, then add_forward. At -tp 1 exactly add_forward."""
        fused = tp.fused_add_rms_norm_for(x)
        if fused is not None and residual.is_contiguous():
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        return self.add_forward(tp.all_reduce(x), residual)
