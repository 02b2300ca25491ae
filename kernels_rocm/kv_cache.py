"""Paged KV-cache writes: scatter this step's key/value rows into their cache slots.

One program per token copies all its heads. Slot -1 means "do not write" (padding tokens of a
captured batch). Slots are int64 and every cache offset is formed in int64, so block ids past
65,535 and pools past 4 GiB land where they should.

Two front ends share one kernel that writes up to two sources per token:
- MHA/GQA: key -> k_cache, value -> v_cache, caches [num_blocks, block_size, kv_heads, head_dim].
- MLA: c_kv -> columns [0, L) and k_pe -> columns [L, L+R) of one latent row per token, cache
  [num_blocks, block_size, L+R], so the caller never concatenates the two.

FP8 caches (e4m3fn or e4m3fnuz, from the cache's dtype) store round(clamp(x / scale, +-max)) with
one fp32 scale per cache tensor, read from a 1-element device tensor (model_ops.quant.fp8 is the
reference). The rounding to the e4m3 grid is done in fp32 before the cast (see `_round_to_e4m3`),
so the cast itself is exact on every backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import (
    FP8_DTYPES,
    SUPPORTED_DTYPES,
    check_dim,
    check_kv_scale,
    check_same_device,
    check_tensor,
    fp8_max,
)

CACHE_DTYPES = SUPPORTED_DTYPES + FP8_DTYPES


@triton.jit
def _round_to_e4m3(v, MIN_NORMAL_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    """Round fp32 values (already within +-max) to the nearest e4m3 value, ties to even.

    e4m3 has 3 mantissa bits, so in the binade [2^e, 2^(e+1)) its spacing is 2^(e-3), and below
    the smallest normal 2^MIN_NORMAL_EXP (-6 fn, -7 fnuz) the subnormal spacing is that of the
    lowest binade. Adding C = 2^(e+20) (whose fp32 ulp is 2^(e-3)) and subtracting it again
    rounds to that spacing with the FPU's round-to-nearest-even. Done by hand because the Triton
    interpreter's fp32 -> fp8 cast does not round to nearest even; after it every cast is exact.
    The sign is copied bit for bit (-0.0 stays -0.0, as torch's cast keeps it); fnuz has no
    negative zero (its 0x80 is NaN), so SIGNED_ZERO=False makes zeros positive.
    """
    mag = tl.abs(v)
    exponent = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_NORMAL_EXP)
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (mag + magic) - magic
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    signed = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    if SIGNED_ZERO:
        return signed
    return tl.where(rounded == 0.0, 0.0, signed)


@triton.jit
def _store_rows(rows, dst, mask, scale_ptr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                MIN_NORMAL_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    if FP8:
        scaled = tl.math.div_rn(rows.to(tl.float32), tl.load(scale_ptr))
        rows = _round_to_e4m3(tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX), MIN_NORMAL_EXP, SIGNED_ZERO)
    tl.store(dst, rows.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _write_rows_kernel(
    slot_mapping_ptr,
    src_a_ptr, cache_a_ptr, scale_a_ptr,
    src_b_ptr, cache_b_ptr, scale_b_ptr,
    stride_src_a_t: tl.int64, stride_src_a_h: tl.int64,
    stride_src_b_t: tl.int64, stride_src_b_h: tl.int64,
    stride_cache_a_blk: tl.int64, stride_cache_a_tok: tl.int64, stride_cache_a_h: tl.int64,
    stride_cache_b_blk: tl.int64, stride_cache_b_tok: tl.int64, stride_cache_b_h: tl.int64,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    DIM_A: tl.constexpr, DIM_A_PAD: tl.constexpr,
    DIM_B: tl.constexpr, DIM_B_PAD: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    head_valid = heads < NUM_HEADS

    dims_a = tl.arange(0, DIM_A_PAD)
    mask_a = head_valid[:, None] & (dims_a < DIM_A)[None, :]
    rows_a = tl.load(
        src_a_ptr + token * stride_src_a_t + heads[:, None] * stride_src_a_h + dims_a[None, :],
        mask=mask_a,
    )
    dst_a = cache_a_ptr + block * stride_cache_a_blk + offset_in_block * stride_cache_a_tok
    _store_rows(rows_a, dst_a + heads[:, None] * stride_cache_a_h + dims_a[None, :], mask_a, scale_a_ptr,
                FP8, FP8_MAX, MIN_NORMAL_EXP, SIGNED_ZERO)
    if HAS_B:
        dims_b = tl.arange(0, DIM_B_PAD)
        mask_b = head_valid[:, None] & (dims_b < DIM_B)[None, :]
        rows_b = tl.load(
            src_b_ptr + token * stride_src_b_t + heads[:, None] * stride_src_b_h + dims_b[None, :],
            mask=mask_b,
        )
        dst_b = cache_b_ptr + block * stride_cache_b_blk + offset_in_block * stride_cache_b_tok
        _store_rows(rows_b, dst_b + heads[:, None] * stride_cache_b_h + dims_b[None, :], mask_b, scale_b_ptr,
                    FP8, FP8_MAX, MIN_NORMAL_EXP, SIGNED_ZERO)


def _launch_write(
    slot_mapping: torch.Tensor,
    src_a: torch.Tensor,
    cache_a: torch.Tensor,
    src_b: torch.Tensor | None,
    cache_b: torch.Tensor | None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> None:
    """src_* [T, H, D*]; cache_* [num_blocks, block_size, H, D*] (possibly column-offset views);
    scale_* the fp8 scales (both caches are fp8 or neither)."""
    num_tokens, num_heads, dim_a = src_a.shape
    if num_tokens == 0:
        return
    has_b = src_b is not None
    src_b_ = src_b if has_b else src_a
    cache_b_ = cache_b if has_b else cache_a
    dim_b = src_b_.shape[2]
    fp8 = cache_a.dtype in FP8_DTYPES
    scale_a_ = scale_a if fp8 else slot_mapping  # any pointer: unused without FP8
    scale_b_ = scale_b if fp8 and has_b else scale_a_
    _write_rows_kernel[(num_tokens,)](
        slot_mapping,
        src_a, cache_a, scale_a_,
        src_b_, cache_b_, scale_b_,
        src_a.stride(0), src_a.stride(1),
        src_b_.stride(0), src_b_.stride(1),
        cache_a.stride(0), cache_a.stride(1), cache_a.stride(2),
        cache_b_.stride(0), cache_b_.stride(1), cache_b_.stride(2),
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        DIM_A=dim_a, DIM_A_PAD=triton.next_power_of_2(dim_a),
        DIM_B=dim_b, DIM_B_PAD=triton.next_power_of_2(dim_b),
        HAS_B=has_b,
        BLOCK_SIZE=cache_a.shape[1],
        FP8=fp8, FP8_MAX=fp8_max(cache_a.dtype) if fp8 else 0.0,
        MIN_NORMAL_EXP=-7 if cache_a.dtype == torch.float8_e4m3fnuz else -6,
        SIGNED_ZERO=cache_a.dtype != torch.float8_e4m3fnuz,
        **pdl.launch_args(src_a.device),
    )


def _check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    check_dim("slot_mapping", slot_mapping, 0, num_tokens, "one slot per token")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key [T, Hkv, D] (and value [T, Hkv, Dv]) into k_cache [NB, BS, Hkv, D] (and v_cache
    [NB, BS, Hkv, Dv]) at `slot_mapping` [T] int64 (slot = block_id * BS + offset; -1 = skip).

    Caches may be strided views of a larger pool (e.g. pool[0, layer]); values are cast to the
    cache dtype. fp8 caches take k_scale / v_scale (1-element fp32 tensors): x / scale is stored.
    """
    check_tensor("key", key, 3, SUPPORTED_DTYPES)
    check_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    check_dim("k_cache", k_cache, 2, key.shape[1], "key's kv heads")
    check_dim("k_cache", k_cache, 3, key.shape[2], "key's head dim")
    _check_slot_mapping(slot_mapping, key.shape[0])
    if (value is None) != (v_cache is None):
        raise ValueError("value and v_cache must both be given or both be None")
    if value is not None:
        check_tensor("value", value, 3, SUPPORTED_DTYPES)
        check_tensor("v_cache", v_cache, 4, CACHE_DTYPES)
        if v_cache.dtype != k_cache.dtype:
            raise ValueError(f"v_cache dtype {v_cache.dtype} must equal k_cache dtype {k_cache.dtype}")
        check_dim("value", value, 0, key.shape[0], "key's tokens")
        check_dim("value", value, 1, key.shape[1], "key's kv heads")
        check_dim("v_cache", v_cache, 0, k_cache.shape[0], "k_cache's blocks")
        check_dim("v_cache", v_cache, 1, k_cache.shape[1], "k_cache's block size")
        check_dim("v_cache", v_cache, 2, value.shape[1], "value's kv heads")
        check_dim("v_cache", v_cache, 3, value.shape[2], "value's head dim")
    check_kv_scale("k_scale", k_scale, "k_cache", k_cache)
    if v_cache is not None:
        check_kv_scale("v_scale", v_scale, "v_cache", v_cache)
    elif v_scale is not None:
        raise ValueError("v_scale was given without value / v_cache")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    _launch_write(slot_mapping, key, k_cache, value, v_cache, k_scale, v_scale)


def write_mla_kv_cache(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Write latent rows [c_kv [T, L] | k_pe [T, R]] into kv_cache [NB, BS, L+R] at
    `slot_mapping` [T] int64 (-1 = skip), without materializing the concatenation. An fp8 cache
    takes `scale` (1-element fp32 tensor), one for the whole row."""
    check_tensor("c_kv", c_kv, 2, SUPPORTED_DTYPES)
    check_tensor("k_pe", k_pe, 2, SUPPORTED_DTYPES)
    check_tensor("kv_cache", kv_cache, 3, CACHE_DTYPES)
    check_kv_scale("scale", scale, "kv_cache", kv_cache)
    check_dim("k_pe", k_pe, 0, c_kv.shape[0], "c_kv's tokens")
    latent = c_kv.shape[1]
    check_dim("kv_cache", kv_cache, 2, latent + k_pe.shape[1], "c_kv width + k_pe width")
    _check_slot_mapping(slot_mapping, c_kv.shape[0])
    check_same_device(c_kv=c_kv, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    # One "head" per token; the rope part is a column-offset view of the same rows.
    _launch_write(
        slot_mapping,
        c_kv.unsqueeze(1), kv_cache[..., :latent].unsqueeze(2),
        k_pe.unsqueeze(1), kv_cache[..., latent:].unsqueeze(2),
        scale, scale,
    )
