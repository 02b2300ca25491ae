"""The aiter adapters on real aiter (ROCm gfx942 / gfx950 only; skipped elsewhere, with why).

NOT YET RUN ANYWHERE: this project had no AMD GPU. The same cases as tests/test_aiter.py, with the
real kernels instead of the emulation: MLA decode / verify (1, 2, 4 rows, 8 / 16 / 64 heads, bf16
and fp8 caches, block ids past 65,535) against the torch reference, and the MXFP4 fused MoE
against the fp32 dequantize reference, no further from it than the Triton kernel in bf16.
Run on an MI300X / MI355X: OUT=/tmp/out GPU_TESTS=tests/gpu/test_aiter_gpu.py ci/gpu_check.sh tests
"""
from __future__ import annotations

import pytest
import torch

from kernels_rocm.aiter_ops import AiterMXFP4MoE, aiter_unavailable_reason, detect_platform

WHY_NOT = aiter_unavailable_reason(detect_platform(torch.device("cuda"))) if torch.cuda.is_available() else "no GPU"
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"aiter cannot run here: {WHY_NOT}")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("num_heads", [8, 16, 64])
def test_aiter_mla_matches_the_reference(fp8, q_len, num_heads):
    from test_aiter import fp8_query_roundtrip, mla_step

    from model_ops.attention import torch_ref
    from model_ops.attention.backends import AiterMLABackend
    from model_ops.attention.metadata import AttentionMetadata
    from model_ops.quant.fp8 import fp8_kv_dtype

    dev = torch.device("cuda")
    kv_dtype = fp8_kv_dtype(dev) if fp8 else torch.bfloat16
    ctx = [q_len + 700, q_len, q_len + 37, q_len + 1]
    q_latent, q_pe, cache, meta, kv_scale = mla_step([q_len] * 4, ctx, num_heads, kv_dtype, latent=512, rope=64,
                                                     block_size=2, seed=q_len)
    q_latent, q_pe, cache = q_latent.to(dev), q_pe.to(dev), cache.to(dev)
    meta = AttentionMetadata(meta.query_start_loc.to(dev), meta.context_lens.to(dev), meta.block_tables.to(dev),
                             meta.slot_mapping.to(dev), meta.max_query_len, meta.max_context_len)
    kv_scale = None if kv_scale is None else kv_scale.to(dev)
    scale = 192 ** -0.5
    out = AiterMLABackend().attend_absorbed(q_latent, q_pe, cache, meta, scale, None if kv_scale is None else (kv_scale,))
    if fp8:
        q_latent, q_pe = fp8_query_roundtrip(q_latent, q_pe, kv_dtype)
    expected = torch_ref.mla_absorbed_attention(q_latent, q_pe, cache, meta, scale, kv_scale)
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    print(f"aiter MLA {kv_dtype} q_len {q_len} heads {num_heads}: relative error {err:.2e}")
    assert err < 2e-2


def test_aiter_mxfp4_moe_matches_the_reference():
    from test_aiter import mxfp4_experts

    from kernels_rocm.mxfp4_moe import fused_moe_mxfp4
    from model_ops.quant.mxfp4_layers import fused_moe_mxfp4_reference

    dev = torch.device("cuda")
    num_experts, hidden, inter, tokens, top_k = 16, 1024, 512, 64, 4
    weights = [t.to(dev) for t in mxfp4_experts(num_experts, hidden, inter)]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    topk_ids = torch.rand(tokens, num_experts, device=dev, generator=g).argsort(-1)[:, :top_k]
    topk_weights = torch.rand(tokens, top_k, device=dev, generator=g)
    expected = fused_moe_mxfp4_reference(x.float(), *weights, topk_weights, topk_ids, quantize_activations=True)
    triton_out = fused_moe_mxfp4(x, *weights, topk_weights, topk_ids, quantize_activations=True)
    moe = AiterMXFP4MoE()
    moe.shuffle_in_place(*weights)
    out = moe(x, topk_weights, topk_ids)

    def rel(a):
        return ((a.float() - expected).norm() / expected.norm()).item()

    print(f"aiter MXFP4 MoE relative error {rel(out):.3e}; Triton bf16 {rel(triton_out):.3e}")
    assert rel(out) <= max(2 * rel(triton_out), 1e-2)
