"""The MLA layer: absorbed and expanded forms agree on random inputs, and both agree with a
direct per-token computation from the un-cached (q, k, v)."""
from __future__ import annotations

import torch
from test_attention_reference import random_batch

from model_ops.attention.backends import MLABackend, TorchMLABackend, select_backend
from model_ops.attention.mla import MLAAttention

HEADS, LATENT, NOPE, ROPE, V = 4, 32, 16, 8, 12
NUM_BLOCKS, BLOCK_SIZE = 40, 8


def make_layer(gen: torch.Generator) -> MLAAttention:
    layer = MLAAttention(HEADS, LATENT, NOPE, ROPE, V, scale=0.3)
    layer.kv_b_proj.weight.copy_(torch.randn(HEADS * (NOPE + V), LATENT, generator=gen) * 0.2)
    return layer


def direct(layer, q_nope, q_pe, cache, meta):
    """Per token: expand its sequence's latent rows 0..pos and attend in float64."""
    out = []
    for b in range(meta.num_seqs):
        c = int(meta.context_lens[b])
        rows = range(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
        slots = [int(meta.block_tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c)]
        latent_rows = cache.flatten(0, 1)[slots].double()
        k_nope, v = layer.expand(latent_rows[:, :LATENT].float())
        keys = torch.cat([k_nope.double(), latent_rows[:, None, LATENT:].expand(-1, HEADS, -1)], dim=-1)
        for j, t in enumerate(rows):
            pos = c - len(rows) + j
            q = torch.cat([q_nope[t], q_pe[t]], dim=-1).double()
            s = torch.einsum("hd,shd->hs", q, keys[: pos + 1]) * layer.scale
            out.append(torch.einsum("hs,shd->hd", s.softmax(-1), v[: pos + 1].double()))
    return torch.stack(out).flatten(1)


def test_absorbed_equals_expanded_on_random_inputs():
    gen = torch.Generator().manual_seed(0)
    ctx, qlen = [37, 5, 64, 1, 20], [37, 1, 4, 1, 9]  # prefill, decode, verify, first token, chunk over a prefix
    meta = random_batch(ctx, qlen, NUM_BLOCKS, BLOCK_SIZE, gen)
    layer = make_layer(gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT + ROPE, generator=gen)  # the cached prefixes
    layer.bind_kv_cache(cache, TorchMLABackend())
    tokens = sum(qlen)
    q_nope, q_pe = torch.randn(tokens, HEADS, NOPE, generator=gen), torch.randn(tokens, HEADS, ROPE, generator=gen)
    latent, k_pe = torch.randn(tokens, LATENT, generator=gen), torch.randn(tokens, ROPE, generator=gen)

    absorbed = layer.attend(q_nope, q_pe, latent, k_pe, meta, absorbed=True)
    expanded = layer.attend(q_nope, q_pe, latent, k_pe, meta, absorbed=False)  # rewrites the same rows
    assert torch.equal(cache.flatten(0, 1)[meta.slot_mapping], torch.cat([latent, k_pe], dim=-1))
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(absorbed.double(), direct(layer, q_nope, q_pe, cache, meta), rtol=1e-5, atol=1e-5)


def test_cpu_selects_the_torch_mla_backend():
    backend = select_backend("mla", torch.device("cpu"), "target")
    assert isinstance(backend, MLABackend) and backend.name == "torch"
