"""The decode-path fusions compiled, in bf16, at Llama-3.1-8B / Kimi sizes (needs a CUDA or ROCm GPU):
rope + KV write (MHA 32/8 heads D=128; MLA 64 heads, L=512, R=64; bf16 and fp8 caches), SiLU-and-mul
(I=14336), the GEMV-style skinny GEMM (M <= 8) and its per-head form for MLA's absorbed W_UK / W_UV
products (Kimi TP8 and TP1 heads), each against the eager ops it replaces on the same inputs.

The rope kernel computes x * cos + r * sin in fp32 and rounds once (the compiler also contracts it
into a fused multiply-add), where the eager ops round each product and the sum to bf16: on an H100
(2026-11-22) about 20% of rotated elements differ from the eager path by one bf16 ulp. So both
are checked against the rope computed in fp32 and rounded once to the stored dtype: the kernel
within one ulp of it everywhere, and off it on no more elements than the eager path. SiLU-and-mul may differ where exp()
differs by an ulp (at most 1% of elements, each by one bf16 ulp); the GEMM by accumulation order
(one bf16 ulp of the fp32 product). On the CPU interpreter the rope kernel is bit-exact (tests/test_kernels_rope_kv_cache.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from kernels_rocm.activation import silu_and_mul
from kernels_rocm.rms_norm import rms_norm, rms_norm_reference
from kernels_rocm.rope_kv_cache import rope_write_kv_cache, rope_write_mla_kv_cache
from kernels_rocm.skinny_gemm import skinny_bmm, skinny_gemm
from model_ops.attention import torch_ref
from model_ops.attention.mla import MLAAttention
from model_ops.linear import dense_per_head
from model_ops.quant.fp8 import quantize_fp8
from model_ops.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
DEVICE, DT = "cuda", torch.bfloat16


def assert_as_accurate(got: torch.Tensor, eager: torch.Tensor, ideal: torch.Tensor,
                       scale: torch.Tensor | None = None) -> None:
    """`got` (the kernel) differs from `ideal` (fp32 math rounded once) on no more elements than
    `eager` does, each by at most one ulp of the stored dtype at the scale of the rotated terms
    (inputs ~N(0, 1), so terms below 4: bf16 2^-6; e4m3 2^-3 relative) - a sum that cancels to a
    small result keeps the rounding error of its terms."""
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        # one e4m3 step of the result (2^-3 relative) on top of the bf16 step at the terms' scale
        rtol, atol = 2**-3 * 1.01, 2**-6
        got, eager, ideal = (t.float() * float(scale) for t in (got, eager, ideal))
    else:
        rtol, atol = 2**-7, 2**-6
    ours, theirs = (got != ideal).float().mean().item(), (eager != ideal).float().mean().item()
    print(f"elements off the once-rounded fp32 result: kernel {ours:.2%}, eager ops {theirs:.2%}")
    assert ours <= theirs + 1e-3
    torch.testing.assert_close(got.float(), ideal.float(), rtol=rtol, atol=atol)


def _setup(rot: int, interleaved: bool, tokens: int, g):
    with torch.device(DEVICE):
        rotary = RotaryEmbedding(LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0),
                                 rot, interleaved)
    positions = torch.randint(0, 8192, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(64 * 16, generator=g)[:tokens].to(DEVICE)
    slots[1::7] = -1
    return rotary, rotary.cos_sin(positions, DT), slots


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("tokens", [1, 37, 513])
def test_rope_write_mha(fp8, tokens):
    g = torch.Generator().manual_seed(tokens)
    rotary, (cos, sin), slots = _setup(128, False, tokens, g)
    qkv = torch.randn(tokens, (32 + 16) * 128, generator=g).to(DEVICE, DT)
    q, k, v = (t.view(tokens, -1, 128) for t in qkv.split([4096, 1024, 1024], dim=-1))
    cache_dtype = torch.float8_e4m3fn if fp8 else DT
    k_cache = torch.randn(64, 16, 8, 128, generator=g).to(DEVICE, cache_dtype)
    v_cache = torch.randn(64, 16, 8, 128, generator=g).to(DEVICE, cache_dtype)
    scales = dict(k_scale=torch.tensor([0.05], device=DEVICE), v_scale=torch.tensor([0.02], device=DEVICE)) if fp8 else {}
    k_eager, v_ref, k_ideal = k_cache.clone(), v_cache.clone(), k_cache.clone()
    ideal = {name: rotary.apply(x.float(), cos.float(), sin.float()) for name, x in (("q", q), ("k", k))}
    for cache, rows, scale in ((k_eager, rotary.apply(k, cos, sin), scales.get("k_scale")), (v_ref, v, scales.get("v_scale")),
                               (k_ideal, ideal["k"], scales.get("k_scale"))):
        if fp8:
            torch_ref.write_cache(cache.view(torch.uint8), quantize_fp8(rows, scale, cache_dtype).view(torch.uint8), slots)
        else:
            torch_ref.write_cache(cache, rows.to(DT), slots)
    q_out = rope_write_kv_cache(q, k, v, k_cache, v_cache, cos, sin, slots, **scales)
    assert_as_accurate(q_out, rotary.apply(q, cos, sin), ideal["q"].to(DT))
    assert_as_accurate(k_cache, k_eager, k_ideal, scales.get("k_scale"))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))  # v is not rotated: bit for bit


@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_write_mla(tokens):
    g = torch.Generator().manual_seed(tokens)
    rotary, (cos, sin), slots = _setup(64, True, tokens, g)
    q = torch.randn(tokens, 64, 192, generator=g).to(DEVICE, DT)
    c_kv, k_pe = torch.randn(tokens, 576, generator=g).to(DEVICE, DT).split([512, 64], dim=-1)
    cache = torch.randn(64, 16, 576, generator=g).to(DEVICE, DT)
    eager, ideal = cache.clone(), cache.clone()
    for target, rope in ((eager, rotary.apply(k_pe.unsqueeze(1), cos, sin)),
                         (ideal, rotary.apply(k_pe.float().unsqueeze(1), cos.float(), sin.float()).to(DT))):
        torch_ref.write_cache(target, torch.cat([c_kv, rope.squeeze(1)], -1), slots)
    q_out = rope_write_mla_kv_cache(q[..., 128:], c_kv, k_pe, cache, cos, sin, slots)
    q_ideal = rotary.apply(q[..., 128:].float(), cos.float(), sin.float()).to(DT)
    assert_as_accurate(q_out, rotary.apply(q[..., 128:], cos, sin), q_ideal)
    assert_as_accurate(cache, eager, ideal)
    assert torch.equal(cache[..., :512], eager[..., :512])  # the latent part is copied, not rotated


@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_silu_and_mul(tokens):
    x = (torch.randn(tokens, 2 * 14336, generator=torch.Generator().manual_seed(tokens)) * 3).to(DEVICE, DT)
    gate, up = x.chunk(2, dim=-1)
    out, expected = silu_and_mul(x), F.silu(gate) * up  # the eager ops model_ops.activation runs on CPU
    differ = out != expected
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(out, expected, atol=0.0, rtol=2**-7)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n_k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 4100)],
                         ids=["qkv", "o_proj", "gate_up", "down", "odd"])
def test_skinny_gemm(m, n_k):
    """Each output rounded once from an fp32 sum (cuBLAS, bf16 in and out, does the same in another
    order): within one bf16 ulp of the fp32 product, and bit-identical run to run (no atomics)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, n_k[1], generator=g).to(DEVICE, DT)
    w = (torch.randn(*n_k, generator=g) * 0.02).to(DEVICE, DT)
    ref = F.linear(x.float(), w.float())
    out = skinny_gemm(x, w)
    assert out.dtype == DT and out.shape == (m, n_k[0])
    assert ((out.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-4).all()  # atol: fp32 summation order
    assert torch.equal(out, skinny_gemm(x, w))


@pytest.mark.parametrize("m", [1, 4])
def test_skinny_gemm_swiglu_epilogue(m):
    """SwiGLU in the GEMV's epilogue: bit-identical to the GEMV's output through the SiLU-and-mul
    kernel (the model's unfused path) at the 8B gate_up shape."""
    g = torch.Generator().manual_seed(20 + m)
    x = torch.randn(m, 4096, generator=g).to(DEVICE, DT)
    w = (torch.randn(28672, 4096, generator=g) * 0.02).to(DEVICE, DT)
    fused = skinny_gemm(x, w, swiglu=True)
    assert fused.shape == (m, 14336)
    assert torch.equal(fused, silu_and_mul(skinny_gemm(x, w)))


@pytest.mark.parametrize("t", [1, 4, 8])
@pytest.mark.parametrize("heads", [8, 64], ids=["kimi_tp8", "kimi_tp1"])
def test_mla_absorption_products(t, heads):
    """MLAAttention's absorbed products at Kimi's dims (P 128, R 64, V 128, L 512) on the layer's own
    operands: W_UK^T made by process_weights_after_loading on NVIDIA, q_nope a strided view of q.
    Through dense_per_head (the kernel on NVIDIA up to 16 heads; bmm on ROCm and at 64 heads, where it
    measured faster): within one bf16 ulp of the fp32 product, bit-identical run to run, and the
    kernel's layouts [T, N, L] / [T, N, V] as attend reads them."""
    from model_ops.linear import PER_HEAD_GEMV_MAX_HEADS

    g = torch.Generator().manual_seed(30 + t)
    layer = MLAAttention(heads, 512, 128, 64, 128, 0.1)
    layer.kv_b_proj.weight.data = torch.randn(heads * 256, 512, generator=g) * 0.05
    layer.to(DEVICE, DT).process_weights_after_loading()
    w_uk, w_uv = layer._w_uk_uv()
    kernel = torch.version.hip is None and heads <= PER_HEAD_GEMV_MAX_HEADS  # never ran on AMD: ROCm keeps bmm
    assert (layer.w_uk_t is not None) == kernel
    q_nope = torch.randn(t, heads, 192, generator=g).to(DEVICE, DT)[..., :128]
    out_latent = torch.randn(t, heads, 512, generator=g).to(DEVICE, DT)
    w_uk_t = layer.w_uk_t if kernel else w_uk.transpose(1, 2)
    for x, w, ref in ((q_nope, w_uk_t, torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float())),
                      (out_latent, w_uv, torch.bmm(out_latent.transpose(0, 1).float(), w_uv.float().transpose(1, 2)))):
        ref = ref.transpose(0, 1)
        out = dense_per_head(x, w)
        assert out.shape == ref.shape and out.dtype == DT
        assert ((out.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-4).all()
        assert torch.equal(out, dense_per_head(x, w))
        if kernel:
            assert torch.equal(out, skinny_bmm(x, w))  # dense_per_head took the kernel


def test_greedy_tokens_is_argmax_with_its_ties():
    """The chunked argmax of a few long rows returns torch.argmax's index, first maximum on ties
    (integer-valued logits: many ties, some across chunks)."""
    from model_ops.sampling import greedy_tokens

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, vocab in [(1, 128256), (4, 49152), (8, 163840 // 8), (3, 151936)]:
        logits = torch.randint(-40, 40, (rows, vocab), generator=gen, device="cuda").float()
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1)), (rows, vocab)
        assert torch.equal(greedy_tokens(logits.bfloat16()), logits.bfloat16().argmax(dim=-1)), (rows, vocab)


@pytest.mark.parametrize("tokens", [1, 4, 300])
@pytest.mark.parametrize("grouped", [False, True], ids=["kimi", "deepseek_v3"])
def test_router_kernels_match_reference(tokens, grouped):
    """The MoE router as the GPU runs it (fp32 logits from the GEMV kernel at <= 8 rows, the one-launch
    routing kernel) against the reference (F.linear in fp32, select_experts): the same experts for every
    token, weights within fp32 rounding; bf16 router weights as released, Kimi / DeepSeek-V3 routing."""
    from model_ops.linear import dense_fp32
    from model_ops.moe import GatingConfig, _routing_kernel, select_experts

    experts, groups = (256, (8, 4)) if grouped else (384, (1, 1))
    gating = GatingConfig(experts, 8, "sigmoid", "noaux_tc", *groups, True, 2.827)
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    w = (torch.randn(experts, 7168, generator=g, device=DEVICE) * 0.02).to(DT)
    bias = torch.randn(experts, generator=g, device=DEVICE) * 0.01
    x = torch.randn(tokens, 7168, generator=g, device=DEVICE).to(DT)
    ref_logits = F.linear(x.float(), w.float())
    logits = dense_fp32(x, w)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-4)
    weights, ids = _routing_kernel(logits, bias, gating)
    ref_weights, ref_ids = select_experts(logits, bias, gating)  # same logits: only the routing differs
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-7)


def _one_ulp_apart(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Asserts `got` is within one step of its dtype of `expected` everywhere (bf16: one ulp, so at
    most eps |expected|; e4m3: one code, same sign); returns the fraction of elements that differ."""
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        codes = [t.view(torch.uint8).int() for t in (got, expected)]
        signs_match = (codes[0] ^ codes[1]) & 0x80 == 0
        assert ((codes[0] - codes[1]).abs().le(1) & signs_match | codes[0].eq(codes[1])).all()
        return (codes[0] != codes[1]).float().mean().item()
    ulp = torch.finfo(got.dtype).eps * expected.float().abs()
    assert ((got.float() - expected.float()).abs() <= ulp).all()
    return (got != expected).float().mean().item()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("tokens", [1, 4, 37])
def test_rope_write_mla_fused_latent_norm(fp8, tokens):
    """kv_a_layernorm fused into the MLA rope + KV write at Kimi TP8's shapes (8 heads' q_pe, L 512,
    R 64), against the separate kernels_rocm.rms_norm then the write. Same rounding; only the sum of
    squares runs in another order (another block layout), so a latent element may land one bf16 ulp
    (fp8: one code) away where the fp32 rstd differs in its last bit. q_pe and the rope part: bit for bit."""
    g = torch.Generator().manual_seed(30 + tokens)
    rotary, (cos, sin), slots = _setup(64, True, tokens, g)
    q = torch.randn(tokens, 8, 192, generator=g).to(DEVICE, DT)
    c_kv, k_pe = (torch.randn(tokens, 576, generator=g) * 0.5).to(DEVICE, DT).split([512, 64], dim=-1)
    weight = (1 + 0.2 * torch.randn(512, generator=g)).to(DEVICE, DT)
    cache_dtype = torch.float8_e4m3fn if fp8 else DT
    cache = torch.randn(64, 16, 576, generator=g).to(DEVICE, cache_dtype)
    scale = dict(scale=torch.tensor([0.02], device=DEVICE)) if fp8 else {}
    unfused = cache.clone()
    q_unfused = rope_write_mla_kv_cache(q[..., 128:], rms_norm(c_kv, weight, 1e-6), k_pe, unfused, cos, sin, slots,
                                        **scale)
    q_fused = rope_write_mla_kv_cache(q[..., 128:], c_kv, k_pe, cache, cos, sin, slots, **scale, norm_weight=weight,
                                      norm_eps=1e-6)
    assert torch.equal(q_fused, q_unfused)
    assert torch.equal(cache[..., 512:].view(torch.uint8), unfused[..., 512:].view(torch.uint8))
    differ = _one_ulp_apart(cache[..., :512], unfused[..., :512])
    print(f"latent elements off the unfused path: {differ:.4%}")
    assert differ <= 1e-3


@pytest.mark.parametrize("tokens", [1, 37, 1000])
def test_rope_write_mla_rows_out_equal_a_bf16_cache(tokens):
    """The rows an fp8 write hands back (`rows_out`, what MLA prefill over an fp8 cache attends for its
    own tokens) equal, bit for bit, the rows the same kernel stores into a bf16 cache, at Kimi TP8's
    shapes with the fused latent norm; the fp8 cache holds exactly their rounding."""
    from kernels_rocm.kv_cache import write_mla_kv_cache

    g = torch.Generator().manual_seed(50 + tokens)
    rotary, (cos, sin), slots = _setup(64, True, tokens, g)
    q_pe = torch.randn(tokens, 8, 64, generator=g).to(DEVICE, DT)
    c_kv, k_pe = (torch.randn(tokens, 576, generator=g) * 0.5).to(DEVICE, DT).split([512, 64], dim=-1)
    norm = dict(norm_weight=(1 + 0.2 * torch.randn(512, generator=g)).to(DEVICE, DT), norm_eps=1e-6)
    bf16_cache = torch.randn(max(64, tokens // 16 + 8), 16, 576, generator=g).to(DEVICE, DT)
    fp8_cache = bf16_cache.to(torch.float8_e4m3fn)
    scale = torch.tensor([0.02], device=DEVICE)
    rope_write_mla_kv_cache(q_pe, c_kv, k_pe, bf16_cache, cos, sin, slots, **norm)
    rows = torch.empty(tokens, 576, device=DEVICE, dtype=DT)
    rope_write_mla_kv_cache(q_pe, c_kv, k_pe, fp8_cache, cos, sin, slots, scale=scale, rows_out=rows, **norm)
    written = slots >= 0
    assert torch.equal(rows[written], bf16_cache.flatten(0, 1)[slots[written]])
    expected = fp8_cache.clone()
    write_mla_kv_cache(rows[:, :512], rows[:, 512:], expected, slots, scale=scale)
    assert torch.equal(fp8_cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("m", [4, 9, 8192])
def test_dense_fp32_sums_like_the_fp32_linear(m):
    """A MoE router's fp32 logits of bf16 x and W (Kimi TP8: 384 experts, hidden 7168): the GEMV up to 8 rows
    (within fp32 summation-order error of F.linear(x.float(), W.float())), cuBLAS's bf16 GEMM with an
    fp32 output above. cuBLAS's tensor-core sums are less exact than fp32 SIMT ones: largest error
    relative to the largest logit 1.3e-6 at 9 rows and 8.7e-6 at 8,192 against 2e-7 / 4e-7 for the fp32
    GEMM (H100, 2026-11-27), still far below the bf16 rounding the logits would carry in bf16 (~1e-3:
    SGLang's dsv3_router_gemm also takes bf16 inputs to fp32 logits; vLLM's gate returns bf16)."""
    from model_ops.linear import dense_fp32

    g = torch.Generator().manual_seed(60 + m)
    x = torch.randn(m, 7168, generator=g).to(DEVICE, DT)
    w = (torch.randn(384, 7168, generator=g) * 0.02).to(DEVICE, DT)
    out = dense_fp32(x, w)
    ref = torch.nn.functional.linear(x.double(), w.double())
    assert out.dtype == torch.float32
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    fp32 = torch.nn.functional.linear(x.float(), w.float())
    rel_fp32 = ((fp32.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"max rel err: ours {rel:.2e}, fp32 linear {rel_fp32:.2e}")
    assert rel < (1e-6 if m <= 8 else 5e-5)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_skinny_gemm_rms_norm_prologue(m):
    """q_a_layernorm as the GEMV's prologue at Kimi TP8's q_b_proj (K 1536 -> N 1536, x a view of the
    fused q_a / kv_a output), as model_ops.linear.dense_after_rms_norm launches it on NVIDIA, against
    kernels_rocm.rms_norm then the GEMV: within one bf16 ulp (the sum of squares' order), nearly all
    outputs bit for bit; and close to the eager norm then an fp32 product."""
    from model_ops.layernorm import RMSNorm
    from model_ops.linear import ColumnParallelLinear, dense_after_rms_norm

    g = torch.Generator().manual_seed(40 + m)
    x = (torch.randn(m, 1536 + 576, generator=g) * 3).to(DEVICE, DT)[:, :1536]
    norm = RMSNorm(1536, 1e-6).to(DEVICE, DT)
    norm.weight.copy_(1 + 0.2 * torch.randn(1536, generator=g))
    layer = ColumnParallelLinear(1536, 1536).to(DEVICE, DT)
    layer.weight.copy_(torch.randn(1536, 1536, generator=g) * 0.02)
    fused = skinny_gemm(x, layer.weight, norm_weight=norm.weight, norm_eps=1e-6)
    # the model's path: this kernel on NVIDIA; on ROCm (the GEMV never ran on AMD) the norm, then the GEMM library
    assert torch.equal(dense_after_rms_norm(x, norm, layer), fused if torch.version.hip is None else layer(norm(x)))
    unfused = skinny_gemm(rms_norm(x, norm.weight, 1e-6), layer.weight)
    # an x element one ulp off moves a sum by far less than an output's ulp: at most a rounding flip
    assert ((fused.float() - unfused.float()).abs() <= 2**-7 * unfused.float().abs() + 1e-3).all()
    differ = (fused != unfused).float().mean().item()
    print(f"outputs off the unfused path: {differ:.4%}")
    assert differ <= 0.05
    # the eager (CPU reference) norm, rounded to bf16 as the kernels round it, then an fp32 product:
    # off by the output's rounding, the sum's order and any x element the rstd's last bit moved
    ref = F.linear(rms_norm_reference(x, norm.weight, 1e-6).float(), layer.weight.float())
    assert ((fused.float() - ref).abs() <= 2**-7 * ref.abs() + 2e-3).all()
