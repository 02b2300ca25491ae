"""Host-side helpers shared by the kernel wrappers: input validation, launch constants, device
facts, and one fix to Triton's CPU interpreter.

Nothing here launches a kernel or reads device memory, so every wrapper stays CUDA/HIP-graph
capturable: all decisions are made from shapes, dtypes and host ints.
"""
from __future__ import annotations

import functools
import os

import torch

# Triton picks the interpreter when a kernel is *decorated* (at import), so read the flag the same way.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The interpreter multiplies bf16 tiles wrongly in tl.dot (upstream "not supported yet"), so under
# it every kernel upcasts dot operands to fp32; compiled kernels keep bf16/fp16 operands (fp32 acc).
UPCAST_DOT = INTERPRET


def _fix_interpreter_loop_bounds() -> None:
    """Let the interpreter use runtime loop bounds (`for i in range(start, stop)`) with numpy >= 2.4.

    Triton 3.6's interpreter turns a scalar into a Python int with `int(array)`, but it keeps
    scalars as 1-element 1-D arrays and numpy 2.4 refuses that conversion (TypeError "only
    0-dimensional arrays can be converted to Python scalars"). Same fix as upstream
    triton-lang/triton#9171: squeeze first. Compiled kernels are unaffected.
    """
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_squeezes_index", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._squeezes_index = True
    interpreter._patch_lang_tensor = patched


def _add_interpreter_fnuz() -> None:
    """Let the interpreter hold float8_e4m3fnuz (gfx942's fp8 KV type) as it holds e4m3fn.

    Triton 3.6's interpreter lists fp8e4b8 among its types but cannot map it to its builder type
    (ValueError "fail to convert fp8e4b8 to ir type"). Its generic bit converter decodes fnuz
    correctly (exponent bias 8, no infinities) except 0x80, which fnuz reserves for NaN and the
    KV writes never produce; the writes round to the e4m3 grid before casting, so the encode
    direction is exact too.
    """
    from triton.runtime import interpreter

    patch_core = interpreter._patch_lang_core
    if getattr(patch_core, "_maps_fnuz", False):
        return

    def patched(lang, scope):
        patch_core(lang, scope)
        to_ir = lang.dtype.to_ir

        def with_fnuz(self, builder):
            return builder.get_fp8e4b8_ty() if self.name == "fp8e4b8" else to_ir(self, builder)

        scope.set_attr(lang.dtype, "to_ir", with_fnuz)

    patched._maps_fnuz = True
    interpreter._patch_lang_core = patched


if INTERPRET:
    _fix_interpreter_loop_bounds()
    _add_interpreter_fnuz()

IS_HIP = torch.version.hip is not None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# KV-cache element types besides SUPPORTED_DTYPES: OCP e4m3 (CUDA, gfx950) and its fnuz variant (gfx942)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot` input precision for operands of `dtype`.

    fp32 operands would run as TF32 on NVIDIA by default (10-bit mantissa); ask for IEEE so fp32
    callers get fp32 results. None keeps the backend default for 16-bit operands.
    """
    return "ieee" if dtype == torch.float32 else None


@functools.lru_cache(maxsize=None)
def _compute_units(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_compute_units(device: torch.device) -> int:
    """SMs (CUDA) or CUs (ROCm) of `device`; a small fixed number elsewhere (CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return _compute_units(device.index if device.index is not None else torch.cuda.current_device())


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    contiguous_last_dim: bool = True,
) -> None:
    """Raise ValueError naming `name` unless `tensor` has `ndim` dims, an allowed dtype and a unit
    stride on its last dim (the kernels vectorize along it)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    if contiguous_last_dim and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")


def check_dim(name: str, tensor: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Raise ValueError unless `tensor.shape[dim] == expected` (`what` says where `expected` comes from)."""
    if tensor.shape[dim] != expected:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}: dim {dim} must be {expected} ({what})"
        )


def check_out(out: torch.Tensor | None, like: torch.Tensor, like_name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """An optional caller-provided output must have the shape of the input it mirrors."""
    if out is None:
        return
    check_tensor("out", out, like.dim(), dtypes)
    if out.shape != like.shape:
        raise ValueError(f"out shape {tuple(out.shape)} must equal {like_name} shape {tuple(like.shape)}")


def check_kv_scale(name: str, scale: torch.Tensor | None, cache_name: str, cache: torch.Tensor) -> None:
    """An fp8 cache needs its scale, a 1-element fp32 device tensor (graphs capture its pointer,
    so the value can change without recapture); any other cache takes none."""
    if cache.dtype not in FP8_DTYPES:
        if scale is not None:
            raise ValueError(f"{name} was given but {cache_name} has dtype {cache.dtype}: scales are for fp8 caches only")
        return
    if scale is None:
        raise ValueError(f"{cache_name} has dtype {cache.dtype}: {name} (its fp32 dequantization scale) is required")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"{name} must be a 1-element float32 tensor, got "
                         f"{type(scale).__name__ if not isinstance(scale, torch.Tensor) else (scale.dtype, tuple(scale.shape))}")
    if scale.device != cache.device:
        raise ValueError(f"{name} is on {scale.device} but {cache_name} is on {cache.device}")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 type (448 for e4m3fn, 240 for e4m3fnuz)."""
    return float(torch.finfo(dtype).max)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device: {listing}")
