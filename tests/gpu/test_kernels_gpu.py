"""Compiled kernels vs the fp32 PyTorch references at real model sizes (needs a CUDA or ROCm GPU).

Run: python -m pytest tests/gpu/test_kernels_gpu.py -q   (about 2-3 minutes on an H100, mostly
compilation; peak memory about 20 GB for the > 4 GiB pools).

Tolerance: kernels run in bf16 (fp32 accumulation) and are compared with an fp32 reference on the
same bf16 inputs; the relative error ||out - ref|| / ||ref|| must stay below 1e-2 and every
element must be finite (outputs are poisoned with NaN first).
Sizes: Kimi MLA absorbed decode (L=512, R=64; 8, 16 and 64 heads), Kimi EAGLE3 MHA draft
(8/8 and 64/64 heads, D=128), SmolLM2 (9/3 heads, D=64); contexts up to 32k; block ids >= 65,536
with the 32 KiB block stride of the ATOM/aiter failure and pools past 4 GiB; fused MoE at
E=64/H=2048/I=1024 and a Kimi TP8 shard; RMSNorm at H=7168; graph capture + replay.
"""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import make_metadata, metadata_args  # tests/ is on sys.path via tests/conftest.py
from kernels_rocm.fused_moe import fused_moe, moe_reference
from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from kernels_rocm.mla_decode import mla_paged_attention
from kernels_rocm.paged_attention import paged_attention
from kernels_rocm.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_reference
from model_ops.attention import torch_ref
from model_ops.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

DEVICE = "cuda"
REL_TOL = 1e-2
BLOCK_SIZE = 16

# name -> (query lengths, context lengths)
BATCHES = {
    "decode": ([1] * 8, [1, 15, 16, 17, 1000, 2047, 4096, 8191]),
    "verify_2": ([2] * 6, [2, 33, 100, 1500, 4000, 8192]),
    "verify_4": ([4] * 4, [4, 64, 999, 8000]),
    "chunked_prefill": ([512, 77, 300], [2048, 77, 1000]),
    "mixed": ([1, 4, 300, 2, 1], [5000, 64, 300, 2000, 1]),
    "long_decode": ([1, 1, 1], [32768, 8192, 12345]),
    "long_verify": ([4, 4], [32768, 8200]),
}


def _blocks_needed(ctx_lens, block_size):
    return sum(-(-c // block_size) for c in ctx_lens)


def _metadata(batch, block_size, num_blocks, first_block_id=0, seed=0) -> AttentionMetadata:
    q_lens, ctx_lens = BATCHES[batch]
    meta = make_metadata(q_lens, ctx_lens, block_size, num_blocks, torch.Generator().manual_seed(seed), first_block_id)
    return AttentionMetadata(
        query_start_loc=meta.query_start_loc.to(DEVICE),
        context_lens=meta.context_lens.to(DEVICE),
        block_tables=meta.block_tables.to(DEVICE),
        slot_mapping=meta.slot_mapping.to(DEVICE),
        max_query_len=meta.max_query_len,
        max_context_len=meta.max_context_len,
    )


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float = REL_TOL) -> None:
    out = out.float()
    assert torch.isfinite(out).all(), "output has non-finite elements (unwritten NaN poison?)"
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < tol, f"relative error {rel:.3e} >= {tol}"


def _poisoned(shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------------------- MHA

MHA_DIMS = {"kimi_draft_tp8": (8, 8, 128), "kimi_draft_tp1": (64, 64, 128), "smollm2": (9, 3, 64)}


def _mha_case(dims, batch, num_kv_splits=None, seed=0):
    num_heads, num_kv_heads, head_dim = MHA_DIMS[dims]
    q_lens, ctx_lens = BATCHES[batch]
    num_blocks = _blocks_needed(ctx_lens, BLOCK_SIZE) + 64
    meta = _metadata(batch, BLOCK_SIZE, num_blocks, seed=seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=g, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device=DEVICE, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    out = paged_attention(q, kv[0], kv[1], *metadata_args(meta), scale,
                          out=_poisoned(q.shape), num_kv_splits=num_kv_splits)
    assert_rel_close(out, torch_ref.paged_attention(q.float(), kv[0], kv[1], meta, scale))


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dims", list(MHA_DIMS))
def test_mha(dims, batch):
    if dims == "kimi_draft_tp1" and batch.startswith("long"):
        pytest.skip("64 kv heads x 32k: the fp32 reference alone needs > 10 GB; covered by tp8 dims")
    _mha_case(dims, batch)


@pytest.mark.parametrize("num_kv_splits", [1, 2, 16, 128])
@pytest.mark.parametrize("batch", ["long_decode", "verify_4"])
def test_mha_forced_splits(batch, num_kv_splits):
    _mha_case("kimi_draft_tp8", batch, num_kv_splits)


# ----------------------------------------------------------------------------------------- MLA

LATENT, ROPE = 512, 64


def _mla_case(num_heads, batch, num_kv_splits=None, block_size=BLOCK_SIZE, seed=0):
    q_lens, ctx_lens = BATCHES[batch]
    num_blocks = _blocks_needed(ctx_lens, block_size) + 64
    meta = _metadata(batch, block_size, num_blocks, seed=seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    kv = torch.randn(num_blocks, block_size, LATENT + ROPE, generator=g, device=DEVICE, dtype=torch.bfloat16)
    q_latent = torch.randn(sum(q_lens), num_heads, LATENT, generator=g, device=DEVICE, dtype=torch.bfloat16)
    q_pe = torch.randn(sum(q_lens), num_heads, ROPE, generator=g, device=DEVICE, dtype=torch.bfloat16)
    scale = 192**-0.5  # DeepSeek-V3/Kimi: 1/sqrt(qk_nope + qk_rope)
    out = mla_paged_attention(q_latent, q_pe, kv, *metadata_args(meta), scale,
                              out=_poisoned(q_latent.shape), num_kv_splits=num_kv_splits)
    ref = torch_ref.paged_attention(
        torch.cat([q_latent, q_pe], -1).float(), kv.unsqueeze(2), kv[..., :LATENT].unsqueeze(2), meta, scale
    )
    assert_rel_close(out, ref)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("num_heads", [8, 16, 64])
def test_mla(num_heads, batch):
    _mla_case(num_heads, batch)


@pytest.mark.parametrize("num_kv_splits", [1, 4, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_mla_splits_and_block_sizes(block_size, num_kv_splits):
    _mla_case(8, "long_verify", num_kv_splits, block_size)


# ------------------------------------------------------------------- block ids >= 65,536, > 4 GiB

def _assert_only_slots_changed(pool_view, before_view, slots):
    changed = (pool_view != before_view).flatten(2).any(-1).flatten().nonzero().squeeze(1)
    assert torch.equal(changed, slots[slots >= 0].sort().values)


def test_mha_block_ids_past_65535_in_pool_past_4gib():
    """The exact ATOM failure: 8 kv heads x 128 x 16 tokens x bf16 = 32 KiB per block, so block
    65,536 starts at 2 GiB; the caches are views of one [2, NB, ...] pool of 8.6 GiB and the tables
    use blocks past 2 GiB, then past 4 GiB of each cache (V's are past 8 GiB of the allocation);
    sequence 0 starts in the pool's last block (see make_metadata)."""
    num_kv_heads, head_dim, num_blocks = 8, 128, 140_000
    pool = torch.empty(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    pool.normal_()
    k_cache, v_cache = pool[0], pool[1]
    assert k_cache.stride(0) * 2 == 32 * 1024 and pool.numel() * 2 > 8 * 2**30
    for first_block, batch in [(65_536, "mixed"), (131_072, "verify_4")]:  # > 2 GiB, > 4 GiB
        meta = _metadata(batch, BLOCK_SIZE, num_blocks, first_block_id=first_block)
        num_tokens = sum(BATCHES[batch][0])
        slots = meta.slot_mapping.clone()
        slots[-1] = -1  # a padding token: must not be written
        g = torch.Generator(device=DEVICE).manual_seed(first_block)
        key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=g, device=DEVICE, dtype=torch.bfloat16)
        before = pool.clone()
        write_kv_cache(key, value, k_cache, v_cache, slots)
        _assert_only_slots_changed(k_cache, before[0], slots)
        _assert_only_slots_changed(v_cache, before[1], slots)
        del before
        q = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g, device=DEVICE, dtype=torch.bfloat16)
        ref = torch_ref.paged_attention(q.float(), k_cache, v_cache, meta, head_dim**-0.5)
        for splits in (None, 1, 8):
            out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), head_dim**-0.5,
                                  out=_poisoned(q.shape), num_kv_splits=splits)
            assert_rel_close(out, ref)
    del pool
    torch.cuda.empty_cache()


def test_mla_block_ids_past_65535_in_pool_past_4gib():
    """Kimi latent rows (576 bf16) in 64-token blocks: 72 KiB per block, 70,000 blocks = 4.8 GiB;
    block 65,536 starts at 4.5 GiB; sequence 0's new rows go to the pool's last block."""
    block_size, num_blocks, num_heads = 64, 70_000, 16
    kv_cache = torch.empty(num_blocks, block_size, LATENT + ROPE, device=DEVICE, dtype=torch.bfloat16)
    kv_cache.normal_()
    assert kv_cache.numel() * 2 > 4 * 2**30
    meta = _metadata("verify_4", block_size, num_blocks, first_block_id=65_536)
    num_tokens = sum(BATCHES["verify_4"][0])
    slots = meta.slot_mapping.clone()
    slots[1] = -1  # a padding token: must not be written
    g = torch.Generator(device=DEVICE).manual_seed(1)
    c_kv = torch.randn(num_tokens, LATENT, generator=g, device=DEVICE, dtype=torch.bfloat16)
    k_pe = torch.randn(num_tokens, ROPE, generator=g, device=DEVICE, dtype=torch.bfloat16)
    before = kv_cache.clone()
    write_mla_kv_cache(c_kv, k_pe, kv_cache, slots)
    _assert_only_slots_changed(kv_cache, before, slots)
    del before
    keep = slots >= 0
    assert torch.equal(kv_cache.flatten(0, 1)[slots[keep]], torch.cat([c_kv, k_pe], -1)[keep])

    q_latent = torch.randn(num_tokens, num_heads, LATENT, generator=g, device=DEVICE, dtype=torch.bfloat16)
    q_pe = torch.randn(num_tokens, num_heads, ROPE, generator=g, device=DEVICE, dtype=torch.bfloat16)
    ref = torch_ref.paged_attention(
        torch.cat([q_latent, q_pe], -1).float(), kv_cache.unsqueeze(2), kv_cache[..., :LATENT].unsqueeze(2), meta, 0.07
    )
    for splits in (None, 1, 8):
        out = mla_paged_attention(q_latent, q_pe, kv_cache, *metadata_args(meta), 0.07,
                                  out=_poisoned(q_latent.shape), num_kv_splits=splits)
        assert_rel_close(out, ref)
    del kv_cache
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- MoE

MOE_SHAPES = {"e64_h2048_i1024": (64, 8, 2048, 1024), "kimi_tp8_e384_h7168_i256": (384, 8, 7168, 256)}


def _moe_inputs(shape, num_tokens, seed=0):
    num_experts, top_k, hidden, inter = MOE_SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=DEVICE, dtype=torch.bfloat16)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=DEVICE) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=DEVICE) * inter**-0.5).bfloat16()
    scores = torch.rand(num_tokens, num_experts, generator=g, device=DEVICE)
    scores[:, : num_experts // 4] += 0.5  # skewed routing: a few hot experts, many cold or empty ones
    weights, ids = scores.topk(top_k, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()


@pytest.mark.parametrize("num_tokens", [1, 8, 128, 512])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_fused_moe(shape, num_tokens):
    x, w13, w2, weights, ids = _moe_inputs(shape, num_tokens)
    out = fused_moe(x, w13, w2, weights, ids, out=_poisoned(x.shape))
    assert_rel_close(out, moe_reference(x.float(), w13.float(), w2.float(), weights, ids))


# ------------------------------------------------------------------------------------ RMSNorm

@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_rms_norm_kimi_hidden(num_tokens):
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    x, residual = torch.randn(2, num_tokens, 7168, generator=g, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(7168, generator=g, device=DEVICE, dtype=torch.bfloat16)
    out = rms_norm(x, weight, 1e-6)
    assert_rel_close(out, rms_norm_reference(x, weight, 1e-6).float())
    _assert_rounds_like(out, rms_norm_reference(x, weight, 1e-6))
    expected_residual = x + residual
    out, _ = fused_add_rms_norm(x, residual, weight, 1e-6, out=_poisoned(x.shape))
    assert torch.equal(residual, expected_residual)
    assert_rel_close(out, rms_norm_reference(expected_residual, weight, 1e-6).float())
    _assert_rounds_like(out, rms_norm_reference(expected_residual, weight, 1e-6))


def _assert_rounds_like(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal to the HF-rounded reference except where the kernel's rsqrt and reduction order
    flip a rounding (well under 1%). A weight applied to the fp32 normalised row (one rounding
    instead of two) differs in ~25% of elements while its relative error (~3e-3) passes REL_TOL."""
    mismatch = (out != ref).float().mean().item()
    assert mismatch < 0.01, f"{mismatch:.1%} of elements differ from the HF rounding"


# ------------------------------------------------------------------------------- graph capture

def _capture(fn):
    """Warm up on a side stream (compiles every kernel), then capture `fn` into a CUDA/HIP graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_attention_graph_replay_with_new_metadata(kind):
    """Capture once with one set of contexts/tables, replay with longer ones (same bucket: same
    num_seqs, max_query_len and host max_context_len) and compare with the reference."""
    q_lens, max_ctx = [2, 2, 2, 2], 8192
    num_blocks = 4 * max_ctx // BLOCK_SIZE + 16
    gen = torch.Generator().manual_seed(3)
    metas = [
        make_metadata(q_lens, ctx, BLOCK_SIZE, num_blocks, gen)
        for ctx in ([2, 100, 700, 3000], [8192, 17, 5000, 2])
    ]
    width = max_ctx // BLOCK_SIZE
    static = {
        "query_start_loc": metas[0].query_start_loc.to(DEVICE),
        "context_lens": metas[0].context_lens.to(DEVICE),
        "block_tables": torch.zeros(len(q_lens), width, dtype=torch.int32, device=DEVICE),
    }
    g = torch.Generator(device=DEVICE).manual_seed(4)
    if kind == "mha":
        kv = torch.randn(2, num_blocks, BLOCK_SIZE, 8, 128, generator=g, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(sum(q_lens), 8, 128, generator=g, device=DEVICE, dtype=torch.bfloat16)
        run = lambda: paged_attention(q, kv[0], kv[1], static["query_start_loc"], static["context_lens"],  # noqa: E731
                                      static["block_tables"], 2, max_ctx, 0.088)
        reference = lambda meta: torch_ref.paged_attention(q.float(), kv[0], kv[1], meta, 0.088)  # noqa: E731
    else:
        kv = torch.randn(num_blocks, BLOCK_SIZE, LATENT + ROPE, generator=g, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(sum(q_lens), 8, LATENT + ROPE, generator=g, device=DEVICE, dtype=torch.bfloat16)
        run = lambda: mla_paged_attention(q[..., :LATENT], q[..., LATENT:], kv, static["query_start_loc"],  # noqa: E731
                                          static["context_lens"], static["block_tables"], 2, max_ctx, 0.072)
        reference = lambda meta: torch_ref.paged_attention(  # noqa: E731
            q.float(), kv.unsqueeze(2), kv[..., :LATENT].unsqueeze(2), meta, 0.072)

    def load(meta):
        static["context_lens"].copy_(meta.context_lens)
        static["block_tables"].zero_()
        static["block_tables"][:, : meta.block_tables.shape[1]].copy_(meta.block_tables)

    load(metas[0])
    graph, out = _capture(run)
    for meta in metas:
        load(meta)
        graph.replay()
        device_meta = AttentionMetadata(static["query_start_loc"], static["context_lens"], static["block_tables"],
                                        meta.slot_mapping.to(DEVICE), 2, max(meta.context_lens.tolist()))
        assert_rel_close(out, reference(device_meta))


def test_fused_moe_graph_replay_with_new_routing():
    x, w13, w2, weights, ids = _moe_inputs("e64_h2048_i1024", 32, seed=5)
    graph, out = _capture(lambda: fused_moe(x, w13, w2, weights, ids))
    for seed in (6, 7):
        x2, _, _, weights2, ids2 = _moe_inputs("e64_h2048_i1024", 32, seed=seed)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        assert_rel_close(out, moe_reference(x.float(), w13.float(), w2.float(), weights, ids))
