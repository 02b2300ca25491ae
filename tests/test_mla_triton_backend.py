"""The ("mla", "triton") backend adapter against the torch one: same cache rows, same output.
Runs where kernels_rocm.mla_decode exists, on a GPU or in Triton's CPU interpreter."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
from test_attention_reference import random_batch

from model_ops.attention.backends import TorchMLABackend, TritonMLABackend, select_backend

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("kernels_rocm.mla_decode") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs kernels_rocm.mla_decode and a GPU or TRITON_INTERPRET=1",
)


def test_triton_mla_backend_matches_torch():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    ctx, qlen = [19, 5, 12], [19, 1, 3]  # prefill, decode, verify
    meta = random_batch(ctx, qlen, 16, 4, gen)
    latent_dim, rope_dim, heads, tokens = 32, 16, 4, sum(qlen)
    cache = torch.randn(16, 4, latent_dim + rope_dim, generator=gen)
    latent, k_pe = torch.randn(tokens, latent_dim, generator=gen), torch.randn(tokens, rope_dim, generator=gen)
    q_latent = torch.randn(tokens, heads, latent_dim, generator=gen)
    q_pe = torch.randn(tokens, heads, rope_dim, generator=gen)
    meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})
    outs = []
    for backend in (TorchMLABackend(), TritonMLABackend()):
        c = cache.clone().to(device)
        backend.write(c, (latent.to(device), k_pe.to(device)), meta.slot_mapping)
        outs.append((c.cpu(), backend.attend_absorbed(q_latent.to(device), q_pe.to(device), c, meta, 0.3).cpu()))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)
    if device.type == "cuda":
        assert isinstance(select_backend("mla", device, "target"), TritonMLABackend)


def test_latent_norm_rides_along_the_write():
    """`latent_norm` (DeepseekV2Attention's kv_a_layernorm): the Triton backend's fused rope + norm + write
    (and its unfused write) store what the torch reference stores by running the module, then writing;
    the rotated q_pe agrees too. Slot -1 rows are skipped."""
    from model_ops.layernorm import RMSNorm
    from model_ops.rotary import RotaryEmbedding
    from transformers import LlamaConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(1)
    latent_dim, rope_dim, heads, tokens = 40, 16, 3, 7
    norm = RMSNorm(latent_dim, eps=1e-5).to(device)
    norm.weight.copy_(torch.randn(latent_dim, generator=gen))
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2), rope_dim, interleaved=True)
    cos_sin = tuple(t.to(device) for t in rotary.cos_sin(torch.randint(0, 500, (tokens,), generator=gen), torch.float32))
    latent = (torch.randn(tokens, latent_dim, generator=gen) * 4).to(device)
    k_pe = torch.randn(tokens, rope_dim, generator=gen).to(device)
    q_pe = torch.randn(tokens, heads, rope_dim, generator=gen).to(device)
    slots = torch.randperm(16 * 4, generator=gen)[:tokens].to(device)
    slots[3] = -1
    cache = torch.randn(16, 4, latent_dim + rope_dim, generator=gen).to(device)
    caches, q_outs = [], []
    for backend in (TorchMLABackend(), TritonMLABackend()):
        rotated, unrotated = cache.clone(), cache.clone()
        q_outs.append(backend.write_rotated(rotated, q_pe, (latent, k_pe), rotary, cos_sin, slots, latent_norm=norm))
        backend.write(unrotated, (latent, k_pe), slots, latent_norm=norm)
        caches += [rotated, unrotated]
    torch.testing.assert_close(q_outs[1], q_outs[0], rtol=1e-6, atol=1e-6)
    for got, expected in zip(caches[2:], caches[:2]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    normed = norm(latent)
    assert torch.equal(caches[1].flatten(0, 1)[slots[slots >= 0]], torch.cat([normed, k_pe], -1)[slots >= 0])
    untouched = torch.ones(16 * 4, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert all(torch.equal(c.flatten(0, 1)[untouched], cache.flatten(0, 1)[untouched]) for c in caches)


def test_triton_mla_prefill_matches_torch():
    """The expanded form (prefill, chunks over a cached prefix; scaled_dot_product_attention in the
    Triton backend, the fp32 reference in the torch one) on the same cache rows, fp32."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(2)
    ctx, qlen = [23, 14, 9], [23, 6, 1]
    meta = random_batch(ctx, qlen, 24, 4, gen)
    meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})
    latent_dim, rope_dim, heads, nope, v, tokens = 32, 16, 4, 12, 10, sum(qlen)
    cache = torch.randn(24, 4, latent_dim + rope_dim, generator=gen).to(device)
    w = (torch.randn(heads * (nope + v), latent_dim, generator=gen) * 0.2).to(device)

    def expand(latent):
        kv = (latent @ w.T).view(*latent.shape[:-1], heads, nope + v)
        return kv.split([nope, v], dim=-1)

    q_nope = torch.randn(tokens, heads, nope, generator=gen).to(device)
    q_pe = torch.randn(tokens, heads, rope_dim, generator=gen).to(device)
    outs = [backend.attend_expanded(q_nope, q_pe, cache, meta, 0.3, expand).cpu()
            for backend in (TorchMLABackend(), TritonMLABackend())]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
