"""Deferred weight allocation for the layers a quantization config may replace.

Why: whether a Linear or a layer's routed experts hold float or packed MXFP4 weights is decided
by the checkpoint's quantization config, by module name, once the model is built; allocating the
float weights first is not an option (Kimi-K2.5's routed experts are 2 TB in bf16). Inside
`deferred_weights()` those layers (model_ops.linear, model_ops.moe.FusedExperts) create their
weights on the meta device; the loader swaps the quantized ones for packed modules, then
`materialize` allocates the remaining float weights on the model's device (uninitialised: the
checkpoint fills them).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

_DEFERRED: ContextVar[bool] = ContextVar("deferred_weights", default=False)
_META = torch.device("meta")


@contextmanager
def deferred_weights(enabled: bool = True) -> Iterator[None]:
    token = _DEFERRED.set(enabled)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weight_device() -> torch.device | None:
    """Where a replaceable layer creates its weights: meta while deferred, else the default device."""
    return _META if _DEFERRED.get() else None


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every parameter still on the meta device real (uninitialised) storage on `device`."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                        requires_grad=False)
