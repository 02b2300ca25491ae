"""Bad inputs to the kernel wrappers raise ValueError naming the offending tensor (or argument)."""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import make_metadata, metadata_args
from kernels_rocm._attention_common import MAX_KV_SPLITS, MIN_TOKENS_PER_SPLIT, choose_num_segments
from kernels_rocm.fused_moe import fused_moe
from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from kernels_rocm.mla_decode import mla_paged_attention
from kernels_rocm.paged_attention import paged_attention

NB, BS = 8, 16


@pytest.fixture
def meta():
    return make_metadata([1, 2], [5, 20], BS, NB, torch.Generator().manual_seed(0))


def _kv_args():
    key = torch.randn(3, 2, 16)
    cache = torch.randn(NB, BS, 2, 16)
    return key, key.clone(), cache, cache.clone(), torch.tensor([0, 5, -1])


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), "slot_mapping"),
        (lambda a: a.update(key=a["key"][0]), "key"),
        (lambda a: a.update(k_cache=torch.randn(NB, BS, 3, 16)), "k_cache"),
        (lambda a: a.update(v_cache=torch.randn(NB, BS, 2, 8)), "v_cache"),
        (lambda a: a.update(value=None), "v_cache"),
        (lambda a: a.update(key=a["key"].int()), "key"),
        (lambda a: a.update(k_cache=torch.randn(NB, BS, 2, 32)[..., ::2]), "k_cache"),
    ],
)
def test_write_kv_cache_rejects(mutate, match):
    key, value, k_cache, v_cache, slots = _kv_args()
    args = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)


def test_write_mla_kv_cache_rejects_width():
    with pytest.raises(ValueError, match="kv_cache"):
        write_mla_kv_cache(torch.randn(3, 32), torch.randn(3, 16), torch.randn(NB, BS, 40), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="k_pe"):
        write_mla_kv_cache(torch.randn(3, 32), torch.randn(2, 16), torch.randn(NB, BS, 48), torch.tensor([0, 1, 2]))


def _attention_call(meta, q_heads=4, **overrides):
    args = dict(
        q=torch.randn(3, q_heads, 16),
        k_cache=torch.randn(NB, BS, 2, 16),
        v_cache=torch.randn(NB, BS, 2, 16),
        query_start_loc=meta.query_start_loc,
        context_lens=meta.context_lens,
        block_tables=meta.block_tables,
        max_query_len=meta.max_query_len,
        max_context_len=meta.max_context_len,
        scale=0.25,
    )
    args.update(overrides)
    return paged_attention(**args)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(q=torch.randn(3, 3, 16)), "q has 3 heads"),
        (dict(q=torch.randn(3, 4, 32)), "q has shape"),
        (dict(q=torch.randn(3, 4, 16).bfloat16()), "dtypes must match"),
        (dict(v_cache=torch.randn(NB, BS, 1, 16)), "v_cache shape"),
        (dict(context_lens=torch.tensor([5, 20])), "context_lens"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), "query_start_loc"),
        (dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), "block_tables"),
        (dict(max_context_len=NB * BS + 1), "max_context_len"),
        (dict(max_query_len=0), "max_query_len"),
        (dict(num_kv_splits=3), "num_kv_splits"),
        (dict(out=torch.empty(3, 4, 8)), "out shape"),
    ],
)
def test_paged_attention_rejects(meta, overrides, match):
    with pytest.raises(ValueError, match=match):
        _attention_call(meta, **overrides)


def test_mla_rejects(meta):
    q_latent, q_pe, kv = torch.randn(3, 4, 32), torch.randn(3, 4, 16), torch.randn(NB, BS, 48)
    with pytest.raises(ValueError, match="q_pe"):
        mla_paged_attention(q_latent, torch.randn(3, 2, 16), kv, *metadata_args(meta), 0.1)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_paged_attention(q_latent, q_pe, torch.randn(NB, BS, 40), *metadata_args(meta), 0.1)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_paged_attention(q_latent, q_pe, kv.unsqueeze(2), *metadata_args(meta), 0.1)


def _moe_args():
    return dict(
        x=torch.randn(4, 32),
        w13=torch.randn(3, 2 * 16, 32),
        w2=torch.randn(3, 32, 16),
        topk_weights=torch.rand(4, 2),
        topk_ids=torch.randint(0, 3, (4, 2)),
    )


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(w2=torch.randn(3, 32, 8)), "w2"),
        (dict(w13=torch.randn(3, 31, 32)), "w13"),
        (dict(w13=torch.randn(3, 32, 16)), "w13"),
        (dict(topk_weights=torch.rand(4, 2).bfloat16()), "topk_weights"),
        (dict(topk_ids=torch.rand(4, 2)), "topk_ids"),
        (dict(topk_ids=torch.randint(0, 3, (4, 3))), "topk_ids"),
        (dict(x=torch.randn(4, 32).bfloat16()), "dtypes must match"),
    ],
)
def test_fused_moe_rejects(overrides, match):
    args = _moe_args()
    args.update(overrides)
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


def test_split_policy():
    cpu = torch.device("cpu")  # 4 "compute units" -> target 16 programs
    assert choose_num_segments(2, max_query_len=100, max_context_len=100_000, device=cpu) == 1  # prefill
    assert choose_num_segments(1, 1, 100_000, cpu) == 16  # grid-limited
    assert choose_num_segments(1, 1, 4 * MIN_TOKENS_PER_SPLIT, cpu) == 4  # context-limited
    assert choose_num_segments(16, 1, 100_000, cpu) == 1  # grid already full
    assert choose_num_segments(1, 1, 10**9, cpu) <= MAX_KV_SPLITS
    assert choose_num_segments(1, 1, 100_000, cpu, programs_per_compute_unit=2) == 8  # the MLA kernel's target
