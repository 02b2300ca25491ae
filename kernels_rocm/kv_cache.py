"""Paged KV-cache writes: scatter this step's key/value rows into their cache slots.

One program per token copies all its heads. Slot -1 means "do not write" (padding tokens of a
captured batch). Slots are int64 and every cache offset is formed in int64, so block ids past
65,535 and pools past 4 GiB land where they should.

Two front ends share one kernel that writes up to two sources per token:
- MHA/GQA: key -> k_cache, value -> v_cache, caches [num_blocks, block_size, kv_heads, head_dim].
- MLA: c_kv -> columns [0, L) and k_pe -> columns [L, L+R) of one latent row per token, cache
  [num_blocks, block_size, L+R], so the caller never concatenates the two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm._util import SUPPORTED_DTYPES, check_dim, check_same_device, check_tensor


@triton.jit
def _write_rows_kernel(
    slot_mapping_ptr,
    src_a_ptr, cache_a_ptr,
    src_b_ptr, cache_b_ptr,
    stride_src_a_t: tl.int64, stride_src_a_h: tl.int64,
    stride_src_b_t: tl.int64, stride_src_b_h: tl.int64,
    stride_cache_a_blk: tl.int64, stride_cache_a_tok: tl.int64, stride_cache_a_h: tl.int64,
    stride_cache_b_blk: tl.int64, stride_cache_b_tok: tl.int64, stride_cache_b_h: tl.int64,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    DIM_A: tl.constexpr, DIM_A_PAD: tl.constexpr,
    DIM_B: tl.constexpr, DIM_B_PAD: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
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
    tl.store(
        dst_a + heads[:, None] * stride_cache_a_h + dims_a[None, :],
        rows_a.to(cache_a_ptr.dtype.element_ty),
        mask=mask_a,
    )
    if HAS_B:
        dims_b = tl.arange(0, DIM_B_PAD)
        mask_b = head_valid[:, None] & (dims_b < DIM_B)[None, :]
        rows_b = tl.load(
            src_b_ptr + token * stride_src_b_t + heads[:, None] * stride_src_b_h + dims_b[None, :],
            mask=mask_b,
        )
        dst_b = cache_b_ptr + block * stride_cache_b_blk + offset_in_block * stride_cache_b_tok
        tl.store(
            dst_b + heads[:, None] * stride_cache_b_h + dims_b[None, :],
            rows_b.to(cache_b_ptr.dtype.element_ty),
            mask=mask_b,
        )


def _launch_write(
    slot_mapping: torch.Tensor,
    src_a: torch.Tensor,
    cache_a: torch.Tensor,
    src_b: torch.Tensor | None,
    cache_b: torch.Tensor | None,
) -> None:
    """src_* [T, H, D*]; cache_* [num_blocks, block_size, H, D*] (possibly column-offset views)."""
    num_tokens, num_heads, dim_a = src_a.shape
    if num_tokens == 0:
        return
    has_b = src_b is not None
    src_b_ = src_b if has_b else src_a
    cache_b_ = cache_b if has_b else cache_a
    dim_b = src_b_.shape[2]
    _write_rows_kernel[(num_tokens,)](
        slot_mapping,
        src_a, cache_a,
        src_b_, cache_b_,
        src_a.stride(0), src_a.stride(1),
        src_b_.stride(0), src_b_.stride(1),
        cache_a.stride(0), cache_a.stride(1), cache_a.stride(2),
        cache_b_.stride(0), cache_b_.stride(1), cache_b_.stride(2),
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        DIM_A=dim_a, DIM_A_PAD=triton.next_power_of_2(dim_a),
        DIM_B=dim_b, DIM_B_PAD=triton.next_power_of_2(dim_b),
        HAS_B=has_b,
        BLOCK_SIZE=cache_a.shape[1],
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
) -> None:
    """Write key [T, Hkv, D] (and value [T, Hkv, Dv]) into k_cache [NB, BS, Hkv, D] (and v_cache
    [NB, BS, Hkv, Dv]) at `slot_mapping` [T] int64 (slot = block_id * BS + offset; -1 = skip).

    Caches may be strided views of a larger pool (e.g. pool[0, layer]); values are cast to the
    cache dtype.
    """
    check_tensor("key", key, 3, SUPPORTED_DTYPES)
    check_tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES)
    check_dim("k_cache", k_cache, 2, key.shape[1], "key's kv heads")
    check_dim("k_cache", k_cache, 3, key.shape[2], "key's head dim")
    _check_slot_mapping(slot_mapping, key.shape[0])
    if (value is None) != (v_cache is None):
        raise ValueError("value and v_cache must both be given or both be None")
    if value is not None:
        check_tensor("value", value, 3, SUPPORTED_DTYPES)
        check_tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES)
        check_dim("value", value, 0, key.shape[0], "key's tokens")
        check_dim("value", value, 1, key.shape[1], "key's kv heads")
        check_dim("v_cache", v_cache, 0, k_cache.shape[0], "k_cache's blocks")
        check_dim("v_cache", v_cache, 1, k_cache.shape[1], "k_cache's block size")
        check_dim("v_cache", v_cache, 2, value.shape[1], "value's kv heads")
        check_dim("v_cache", v_cache, 3, value.shape[2], "value's head dim")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    _launch_write(slot_mapping, key, k_cache, value, v_cache)


def write_mla_kv_cache(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write latent rows [c_kv [T, L] | k_pe [T, R]] into kv_cache [NB, BS, L+R] at
    `slot_mapping` [T] int64 (-1 = skip), without materializing the concatenation."""
    check_tensor("c_kv", c_kv, 2, SUPPORTED_DTYPES)
    check_tensor("k_pe", k_pe, 2, SUPPORTED_DTYPES)
    check_tensor("kv_cache", kv_cache, 3, SUPPORTED_DTYPES)
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
    )
