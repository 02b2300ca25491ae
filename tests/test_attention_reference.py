"""The paged reference against a direct per-token computation, including the batch-splitting
path for long prompts and block ids past 65,535."""
from __future__ import annotations

import math

import pytest
import torch

from model_ops.attention.metadata import AttentionMetadata, slots_for_positions
from model_ops.attention.torch_ref import padded_causal_attention, paged_attention, write_cache


def random_batch(ctx, qlen, num_blocks, block_size, gen, min_block_id=0):
    """Metadata for sequences with random, disjoint (permuted) block ids >= min_block_id."""
    need = sum(math.ceil(c / block_size) for c in ctx)
    ids = (torch.randperm(num_blocks - min_block_id, generator=gen)[:need] + min_block_id).tolist()
    width = max(math.ceil(c / block_size) for c in ctx)
    tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    for b, c in enumerate(ctx):
        for i in range(math.ceil(c / block_size)):
            tables[b, i] = ids.pop()
    qsl = torch.tensor([0] + qlen).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(ctx, qlen)])
    seq = torch.repeat_interleave(torch.arange(len(ctx)), torch.tensor(qlen))
    slots = slots_for_positions(tables[seq], positions, block_size)
    return AttentionMetadata(qsl, torch.tensor(ctx, dtype=torch.int32), tables, slots, max(qlen), max(ctx))


def naive(q, k_cache, v_cache, meta, scale):
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = []
    for b in range(meta.num_seqs):
        c = int(meta.context_lens[b])
        rows = range(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
        keys = torch.stack([k_cache[meta.block_tables[b, p // block_size], p % block_size] for p in range(c)])
        vals = torch.stack([v_cache[meta.block_tables[b, p // block_size], p % block_size] for p in range(c)])
        for j, t in enumerate(rows):
            pos = c - len(rows) + j
            k = keys[: pos + 1].repeat_interleave(group, dim=1)
            v = vals[: pos + 1].repeat_interleave(group, dim=1)
            s = torch.einsum("hd,shd->hs", q[t].double(), k.double()) * scale
            out.append(torch.einsum("hs,shd->hd", s.softmax(-1), v.double()))
    return torch.stack(out)


@pytest.mark.parametrize("budget", [None, 700])
def test_reference_matches_direct_computation(budget, monkeypatch):
    if budget is not None:  # force the batch to be split into several groups and query chunks
        monkeypatch.setattr("model_ops.attention.torch_ref.SCORE_BUDGET", budget)
    gen = torch.Generator().manual_seed(0)
    ctx, qlen = [37, 5, 64, 1, 20], [37, 1, 4, 1, 9]  # prefill, decode, verify, first token, chunk over prefix
    meta = random_batch(ctx, qlen, 40, 8, gen)
    k_cache, v_cache = torch.randn(2, 40, 8, 2, 16, generator=gen)
    q = torch.randn(sum(qlen), 6, 16, generator=gen)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out.double(), naive(q, k_cache, v_cache, meta, 0.25), rtol=1e-5, atol=1e-5)


def test_block_ids_past_65535():
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size = 70_000, 4
    k_cache = torch.randn(num_blocks, block_size, 1, 8, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, 1, 8, generator=gen)
    meta = random_batch([9, 14], [3, 14], num_blocks, block_size, gen, min_block_id=65_536)
    assert int((meta.slot_mapping // block_size).min()) >= 65_536  # every written block is past 16 bits
    new_k, new_v = torch.randn(2, int(meta.slot_mapping.numel()), 1, 8, generator=gen)
    before = k_cache.clone()
    write_cache(k_cache, new_k, meta.slot_mapping)
    write_cache(v_cache, new_v, meta.slot_mapping)
    flat = k_cache.flatten(0, 1)
    assert torch.equal(flat[meta.slot_mapping], new_k)
    changed = (flat != before.flatten(0, 1)).any(-1).any(-1).nonzero().squeeze(1)
    assert sorted(changed.tolist()) == sorted(meta.slot_mapping.tolist())  # nothing else was touched
    q = torch.randn(17, 3, 8, generator=gen)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.3).double(),
                               naive(q, k_cache, v_cache, meta, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_core_matches_the_reference(dtype, tol):
    """backends.sdpa_causal_attention (the Triton MLA backend's prefill core) against
    padded_causal_attention: ragged prompts, chunks over cached prefixes and single rows; value width
    other than the key's (MLA: 192 / 128 a head); NaN in the padding past each context stays out."""
    from model_ops.attention.backends import sdpa_causal_attention

    gen = torch.Generator().manual_seed(3)
    ctx, qlen = [37, 20, 9, 64], [37, 18, 1, 5]
    meta = random_batch(ctx, qlen, 40, 4, gen)
    heads, dk, dv, width = 3, 24, 16, max(ctx) + 3
    q = torch.randn(sum(qlen), heads, dk, generator=gen).to(dtype)
    keys = torch.randn(len(ctx), width, heads, dk, generator=gen).to(dtype)
    values = torch.randn(len(ctx), width, heads, dv, generator=gen).to(dtype)
    for b, c in enumerate(ctx):
        keys[b, c:], values[b, c:] = float("nan"), float("nan")
    got = sdpa_causal_attention(q, keys, values, meta, 0.2)
    expected = padded_causal_attention(q, keys, values, meta, 0.2)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
