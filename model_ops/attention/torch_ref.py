"""Pure-PyTorch paged attention: runs on every device and is the oracle for every kernel.

Deliberately simple: gather each sequence's cache rows into a padded batch, then one masked
softmax in fp32. Memory is O(B * max_query_len * max_context_len * heads), fine for tests and
CPU serving; the GPU uses kernels_rocm and is tested against this file.
"""
from __future__ import annotations

import torch

from model_ops.attention.metadata import AttentionMetadata


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `values[t]` at slot `slot_mapping[t]` of `cache` ([num_blocks, block_size, ...]).

    Rows with slot -1 (padding) are skipped.
    """
    flat = cache.flatten(0, 1)
    keep = slot_mapping >= 0
    flat.index_copy_(0, slot_mapping[keep], values[keep].to(flat.dtype))


def gather_cache(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Rows `0 .. length-1` of every sequence: [B, length, ...] from a [num_blocks, block_size, ...] cache.

    Positions past a sequence's context read whatever block its table pads with; callers mask them.
    """
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    block_ids = block_tables[:, pos // block_size].long()  # int64: ids past 65,535 times strides
    slots = block_ids * block_size + pos % block_size
    return cache.flatten(0, 1)[slots]


def token_rows(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, row within the sequence) of each flat query token."""
    qsl = meta.query_start_loc.long()
    seq_idx = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=qsl.device), qsl[1:] - qsl[:-1], output_size=num_tokens
    )
    return seq_idx, torch.arange(num_tokens, device=qsl.device) - qsl[seq_idx]


def padded_causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of flat queries q [T, Hq, Dk] over padded per-sequence keys [B, S, Hkv, Dk] and
    values [B, S, Hkv, Dv]; query row j of sequence b sees keys 0 ..= context_len - q_len + j.
    Returns [T, Hq, Dv] in q's dtype, computed in fp32."""
    num_tokens, num_heads, _ = q.shape
    batch, length, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    seq_idx, row = token_rows(meta, num_tokens)

    q_pad = q.new_zeros(batch, meta.max_query_len, num_heads, q.shape[-1], dtype=torch.float32)
    q_pad[seq_idx, row] = q.float()
    q_pad = q_pad.view(batch, meta.max_query_len, num_kv_heads, group, -1)
    scores = torch.einsum("bqhgd,bshd->bhgqs", q_pad, keys.float()) * scale

    ctx = meta.context_lens.long()
    qlen = meta.query_lens.long()
    q_pos = (ctx - qlen)[:, None] + torch.arange(meta.max_query_len, device=q.device)[None, :]
    visible = torch.arange(length, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, Q, S]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqs,bshd->bqhgd", probs, values.float())
    return out.reshape(batch, meta.max_query_len, num_heads, -1)[seq_idx, row].to(q.dtype)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Paged attention over caches [num_blocks, block_size, Hkv, D]; see AttentionMetadata.

    MLA's absorbed decode is the same call with one KV head: k_cache = latent rows [.., 1, L+R],
    v_cache = the first L columns of the same rows.
    """
    keys = gather_cache(k_cache, meta.block_tables, meta.max_context_len)
    values = gather_cache(v_cache, meta.block_tables, meta.max_context_len)
    return padded_causal_attention(q, keys, values, meta, scale)
