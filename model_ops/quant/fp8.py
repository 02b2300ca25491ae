"""FP8 (e4m3) KV cache values: the reference of how every backend stores and reads them.

A cache entry is round-to-nearest(clamp(x / scale, -max, max)) in the platform's e4m3 type and
reads back as entry * scale, with one fp32 scale per tensor (per layer, per K / V / latent).
Clamping first saturates out-of-range values to +-max, as vLLM's and aiter's cache writes do;
a plain cast would turn them into NaN.

The type is OCP e4m3fn (max 448) on CUDA and on gfx950 (MI350/MI355X), e4m3fnuz (max 240, a
different exponent bias) on gfx942 (MI300), whose matrix units only take that variant.
"""
from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def fp8_kv_dtype(device: torch.device) -> torch.dtype:
    """The e4m3 variant the platform's hardware uses: fnuz on gfx942, OCP fn elsewhere (CPU included)."""
    if device.type == "cuda" and "gfx942" in getattr(torch.cuda.get_device_properties(device), "gcnArchName", ""):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, saturated to the type's range, rounded to `dtype` (computed in fp32)."""
    limit = fp8_max(dtype)
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (x.float() * scale.float()).to(dtype)
