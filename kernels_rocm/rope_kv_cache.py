"""Rotary embedding fused with the paged KV-cache write: one kernel instead of ~15 a layer.

Eagerly, rotating q and k costs a chunk, four multiplies, two adds and a concatenation each, and
the cache write is a kernel of its own; at decode sizes those launches cost more than the bytes.
Here one program per token rotates all its query heads (written to a new q), and, unless its slot
is -1 (padding rows of a captured batch), rotates its key heads and stores them with the value
rows into their cache slot (fp8 caches quantized as kernels_rocm.kv_cache does).

Two front ends share the kernel:
- MHA/GQA: q [T, Hq, D] and key [T, Hkv, D] rotated over the whole head dim; value [T, Hkv, Dv]
  copied; caches [num_blocks, block_size, Hkv, D*].
- MLA: q_pe [T, N, R] rotated; the latent row [c_kv (L) | rope(k_pe) (R)] stored into
  kv_cache [num_blocks, block_size, L + R] (the rope part is a column-offset view, one "head"),
  optionally with c_kv RMS-normalized on the way (DeepSeek's kv_a_layernorm: one launch fewer a layer).

Rotation follows model_ops.rotary exactly: the neox layout pairs (i, i + R/2), the interleaved
(DeepSeek) layout pairs (2i, 2i + 1), and both emit [x1 cos - x2 sin | x2 cos + x1 sin]. Each
product and the sum are rounded to the activation dtype, as the eager elementwise ops round them,
so bf16 results equal the eager path's bit for bit (fp32 too, up to a compiler's fused multiply-add).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import (
    SUPPORTED_DTYPES,
    check_dim,
    check_kv_scale,
    check_same_device,
    check_tensor,
    fp8_max,
)
from kernels_rocm.kv_cache import CACHE_DTYPES, FP8_DTYPES, _store_rows
from kernels_rocm.rms_norm import rms_scale


@triton.jit
def _load_halves(base, heads, stride_h, cols, mask, INTERLEAVED: tl.constexpr, HALF: tl.constexpr):
    """The two halves (x1, x2) of rows base[heads, :], in fp32."""
    if INTERLEAVED:
        first, second = 2 * cols, 2 * cols + 1
    else:
        first, second = cols, cols + HALF
    rows = base + heads[:, None] * stride_h
    x1 = tl.load(rows + first[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(rows + second[None, :], mask=mask).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate(x1, x2, cos, sin, act_ptr):
    """(x1 cos - x2 sin, x2 cos + x1 sin) with every product and sum rounded to the activation
    dtype (`act_ptr`'s element type)."""
    DTYPE = act_ptr.dtype.element_ty
    a = (x1 * cos).to(DTYPE).to(tl.float32)
    b = (x2 * sin).to(DTYPE).to(tl.float32)
    c = (x2 * cos).to(DTYPE).to(tl.float32)
    d = (x1 * sin).to(DTYPE).to(tl.float32)
    return (a - b).to(DTYPE), (c + d).to(DTYPE)


@triton.jit
def _rope_write_kernel(
    slot_mapping_ptr, cos_ptr, sin_ptr,
    q_ptr, q_out_ptr,
    k_ptr, k_cache_ptr, k_scale_ptr,
    v_ptr, v_cache_ptr, v_scale_ptr, norm_weight_ptr, norm_eps, k_rows_ptr, v_rows_ptr,
    stride_cos_t: tl.int64, stride_sin_t: tl.int64,
    stride_q_t: tl.int64, stride_q_h: tl.int64, stride_q_out_t: tl.int64, stride_q_out_h: tl.int64,
    stride_k_t: tl.int64, stride_k_h: tl.int64, stride_v_t: tl.int64, stride_v_h: tl.int64,
    stride_kc_blk: tl.int64, stride_kc_tok: tl.int64, stride_kc_h: tl.int64,
    stride_vc_blk: tl.int64, stride_vc_tok: tl.int64, stride_vc_h: tl.int64,
    stride_rows_t: tl.int64, stride_rows_h: tl.int64,
    Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    DIM_V: tl.constexpr, DIM_V_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    col_valid = cols < HALF
    cos = tl.load(cos_ptr + token * stride_cos_t + cols, mask=col_valid).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin_t + cols, mask=col_valid).to(tl.float32)[None, :]

    # every row's query is rotated, padding rows included (their outputs are never read)
    q_heads = tl.arange(0, Q_HEADS_PAD)
    q_mask = (q_heads < Q_HEADS)[:, None] & col_valid[None, :]
    x1, x2 = _load_halves(q_ptr + token * stride_q_t, q_heads, stride_q_h, cols, q_mask, INTERLEAVED, HALF)
    o1, o2 = _rotate(x1, x2, cos, sin, q_out_ptr)
    q_out = q_out_ptr + token * stride_q_out_t + q_heads[:, None] * stride_q_out_h + cols[None, :]
    tl.store(q_out, o1, mask=q_mask)
    tl.store(q_out + HALF, o2, mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset_in_block = slot % BLOCK_SIZE
        kv_heads = tl.arange(0, KV_HEADS_PAD)
        head_valid = kv_heads < KV_HEADS
        k_mask = head_valid[:, None] & col_valid[None, :]
        # names of their own: a compiled `if` may not rebind q's tiles with another shape
        k1, k2 = _load_halves(k_ptr + token * stride_k_t, kv_heads, stride_k_h, cols, k_mask, INTERLEAVED, HALF)
        k_out1, k_out2 = _rotate(k1, k2, cos, sin, q_out_ptr)
        k_dst = (k_cache_ptr + block * stride_kc_blk + offset_in_block * stride_kc_tok
                 + kv_heads[:, None] * stride_kc_h + cols[None, :])
        _store_rows(k_out1, k_dst, k_mask, k_scale_ptr, FP8, FP8_MAX, MIN_NORMAL_EXP, SIGNED_ZERO)
        _store_rows(k_out2, k_dst + HALF, k_mask, k_scale_ptr, FP8, FP8_MAX, MIN_NORMAL_EXP, SIGNED_ZERO)
        if ROWS:  # the rotated key rows as computed, before any fp8 rounding
            k_rows = k_rows_ptr + token * stride_rows_t + kv_heads[:, None] * stride_rows_h + cols[None, :]
            tl.store(k_rows, k_out1.to(k_rows_ptr.dtype.element_ty), mask=k_mask)
            tl.store(k_rows + HALF, k_out2.to(k_rows_ptr.dtype.element_ty), mask=k_mask)

        dims_v = tl.arange(0, DIM_V_PAD)
        v_mask = head_valid[:, None] & (dims_v < DIM_V)[None, :]
        v_rows = tl.load(v_ptr + token * stride_v_t + kv_heads[:, None] * stride_v_h + dims_v[None, :], mask=v_mask,
                         other=0.0)
        if NORM:
            # RMSNorm of each value row, rounded as kernels_rocm.rms_norm rounds: fp32 statistics,
            # the normalized row rounded to the activation dtype, times the weight, rounded again
            v32 = v_rows.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(v32 * v32, axis=1) / DIM_V + norm_eps)
            weight = tl.load(norm_weight_ptr + dims_v, mask=dims_v < DIM_V, other=0.0)
            v_rows = rms_scale(v32, rstd[:, None], weight[None, :], v_ptr.dtype.element_ty)
        v_dst = (v_cache_ptr + block * stride_vc_blk + offset_in_block * stride_vc_tok
                 + kv_heads[:, None] * stride_vc_h + dims_v[None, :])
        _store_rows(v_rows, v_dst, v_mask, v_scale_ptr, FP8, FP8_MAX, MIN_NORMAL_EXP, SIGNED_ZERO)
        if ROWS:
            tl.store(v_rows_ptr + token * stride_rows_t + kv_heads[:, None] * stride_rows_h + dims_v[None, :],
                     v_rows.to(v_rows_ptr.dtype.element_ty), mask=v_mask)


def _launch(slot_mapping, cos, sin, q, key, k_cache, k_scale, value, v_cache, v_scale, interleaved,
            norm_weight=None, norm_eps=0.0, k_rows=None, v_rows=None) -> torch.Tensor:
    """q [T, Hq, R], key [T, Hkv, R], value [T, Hkv, Dv]; caches [NB, BS, Hkv, *] (maybe
    column-offset views); returns the rotated q [T, Hq, R] (contiguous). `norm_weight` [Dv]: the
    value rows are RMS-normalized (eps `norm_eps`) before they are stored. `k_rows` [T, Hkv, R] /
    `v_rows` [T, Hkv, Dv] (views sharing their token and head strides), when given, receive the
    stored rows before any fp8 rounding (rows of slot -1 are left as they were)."""
    num_tokens, q_heads, rot = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    kv_heads, dim_v = value.shape[1], value.shape[2]
    fp8 = k_cache.dtype in FP8_DTYPES
    k_scale_ = k_scale if fp8 else slot_mapping  # any pointer: unused without FP8
    v_scale_ = v_scale if fp8 else slot_mapping
    _rope_write_kernel[(num_tokens,)](
        slot_mapping, cos, sin,
        q, q_out,
        key, k_cache, k_scale_,
        # without the norm its arguments go as None (constexpr): the plain write compiles as before
        value, v_cache, v_scale_, norm_weight, norm_eps if norm_weight is not None else None, k_rows, v_rows,
        cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *((k_rows.stride(0), k_rows.stride(1)) if k_rows is not None else (0, 0)),
        Q_HEADS=q_heads, Q_HEADS_PAD=triton.next_power_of_2(q_heads),
        KV_HEADS=kv_heads, KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HALF=rot // 2, HALF_PAD=triton.next_power_of_2(rot // 2),
        DIM_V=dim_v, DIM_V_PAD=triton.next_power_of_2(dim_v),
        INTERLEAVED=interleaved, BLOCK_SIZE=k_cache.shape[1], NORM=norm_weight is not None, ROWS=k_rows is not None,
        FP8=fp8, FP8_MAX=fp8_max(k_cache.dtype) if fp8 else 0.0,
        MIN_NORMAL_EXP=-7 if k_cache.dtype == torch.float8_e4m3fnuz else -6,
        SIGNED_ZERO=k_cache.dtype != torch.float8_e4m3fnuz,
        **pdl.launch_args(q.device),
    )
    return q_out


def _check_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, q_name: str) -> None:
    check_tensor(q_name, q, 3, SUPPORTED_DTYPES)
    num_tokens, _, rot = q.shape
    if rot % 2:
        raise ValueError(f"{q_name} has shape {tuple(q.shape)}: the rotary dim (last) must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, 2, SUPPORTED_DTYPES)
        check_dim(name, t, 0, num_tokens, f"{q_name}'s tokens")
        check_dim(name, t, 1, rot // 2, f"half of {q_name}'s rotary dim")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    check_dim("slot_mapping", slot_mapping, 0, num_tokens, "one slot per token")


def rope_write_kv_cache(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [T, Hq, D] and key [T, Hkv, D] by cos/sin [T, D/2]; write the rotated key and
    value [T, Hkv, Dv] into k_cache [NB, BS, Hkv, D] / v_cache [NB, BS, Hkv, Dv] at `slot_mapping`
    [T] int64 (-1 = skip). Returns the rotated q [T, Hq, D]. fp8 caches take k_scale / v_scale."""
    _check_rope(q, cos, sin, slot_mapping, "q")
    check_tensor("key", key, 3, (q.dtype,))
    check_tensor("value", value, 3, SUPPORTED_DTYPES)
    check_dim("key", key, 0, q.shape[0], "q's tokens")
    check_dim("key", key, 2, q.shape[2], "q's head dim")
    check_dim("value", value, 0, q.shape[0], "q's tokens")
    check_dim("value", value, 1, key.shape[1], "key's kv heads")
    check_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,))
    check_dim("k_cache", k_cache, 2, key.shape[1], "key's kv heads")
    check_dim("k_cache", k_cache, 3, key.shape[2], "key's head dim")
    check_dim("v_cache", v_cache, 0, k_cache.shape[0], "k_cache's blocks")
    check_dim("v_cache", v_cache, 1, k_cache.shape[1], "k_cache's block size")
    check_dim("v_cache", v_cache, 2, value.shape[1], "value's kv heads")
    check_dim("v_cache", v_cache, 3, value.shape[2], "value's head dim")
    check_kv_scale("k_scale", k_scale, "k_cache", k_cache)
    check_kv_scale("v_scale", v_scale, "v_cache", v_cache)
    check_same_device(q=q, key=key, value=value, k_cache=k_cache, v_cache=v_cache, cos=cos, sin=sin,
                      slot_mapping=slot_mapping)
    return _launch(slot_mapping, cos, sin, q, key, k_cache, k_scale, value, v_cache, v_scale, interleaved)


def rope_write_mla_kv_cache(
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool = True,
    scale: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    rows_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q_pe [T, N, R] and k_pe [T, R] by cos/sin [T, R/2]; write latent rows
    [c_kv [T, L] | rope(k_pe)] into kv_cache [NB, BS, L + R] at `slot_mapping` [T] int64
    (-1 = skip). Returns the rotated q_pe [T, N, R]. An fp8 cache takes `scale` (whole row).

    With `norm_weight` [L], the row written is [rms_norm(c_kv, norm_weight, norm_eps) | rope(k_pe)],
    rounded exactly as kernels_rocm.rms_norm then this write (an fp8 cache quantizes the rounded
    norm): DeepSeek's kv_a_layernorm, whose only consumer is this write, without a launch of its own.

    `rows_out` [T, L + R] (c_kv's dtype) receives the rows written, before any fp8 rounding: what a
    float cache would hold, bit for bit, for MLA prefill over an fp8 cache to attend its own rows."""
    _check_rope(q_pe, cos, sin, slot_mapping, "q_pe")
    check_tensor("c_kv", c_kv, 2, SUPPORTED_DTYPES)
    check_tensor("k_pe", k_pe, 2, (q_pe.dtype,))
    check_dim("c_kv", c_kv, 0, q_pe.shape[0], "q_pe's tokens")
    check_dim("k_pe", k_pe, 0, q_pe.shape[0], "q_pe's tokens")
    check_dim("k_pe", k_pe, 1, q_pe.shape[2], "q_pe's rotary dim")
    check_tensor("kv_cache", kv_cache, 3, CACHE_DTYPES)
    latent = c_kv.shape[1]
    check_dim("kv_cache", kv_cache, 2, latent + k_pe.shape[1], "c_kv width + k_pe width")
    check_kv_scale("scale", scale, "kv_cache", kv_cache)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, 1, SUPPORTED_DTYPES)
        check_dim("norm_weight", norm_weight, 0, latent, "c_kv width")
    check_same_device(q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, kv_cache=kv_cache, cos=cos, sin=sin, slot_mapping=slot_mapping,
                      norm_weight=norm_weight, rows_out=rows_out)
    rows = {}
    if rows_out is not None:
        check_tensor("rows_out", rows_out, 2, (c_kv.dtype,))
        check_dim("rows_out", rows_out, 0, q_pe.shape[0], "q_pe's tokens")
        check_dim("rows_out", rows_out, 1, kv_cache.shape[2], "kv_cache's row width")
        rows = dict(k_rows=rows_out[:, latent:].unsqueeze(1), v_rows=rows_out[:, :latent].unsqueeze(1))
    # one kv "head" per token: the rope part is a column-offset view of the latent rows
    return _launch(slot_mapping, cos, sin, q_pe,
                   k_pe.unsqueeze(1), kv_cache[..., latent:].unsqueeze(2), scale,
                   c_kv.unsqueeze(1), kv_cache[..., :latent].unsqueeze(2), scale, interleaved, norm_weight, norm_eps,
                   **rows)
