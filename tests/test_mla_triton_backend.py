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
