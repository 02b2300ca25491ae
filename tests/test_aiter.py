"""The aiter adapters (kernels_rocm.aiter_ops) on CPU, against a torch emulation of aiter's entry
points (tests/aiter_emulation.py): what the adapters pass is checked the way aiter's kernels need
it, and what comes back must be the reference attention / MoE output. Nothing here runs aiter
itself: see docs/rocm.md for what this does and does not show."""
from __future__ import annotations

import math

import pytest
import torch
from aiter_emulation import EmulatedAiter

from atom_like.config import EngineArgs
from kernels_rocm import aiter_ops
from kernels_rocm.aiter_ops import AiterMXFP4MoE, Platform, mla_decode_metadata
from model_ops.attention import backends, torch_ref
from model_ops.attention.backends import AiterMLABackend, TorchMLABackend, choose_backend
from model_ops.attention.metadata import AttentionMetadata
from model_ops.quant import mxfp4_layers
from model_ops.quant.fp8 import quantize_fp8
from model_ops.quant.mxfp4 import quantize_mxfp4
from model_ops.quant.mxfp4_layers import choose_mxfp4_experts_backend, fused_moe_mxfp4_reference

CPU = Platform("cpu", False, None, None)
NVIDIA = Platform("cuda", False, None, None)
MI250 = Platform("cuda", True, "gfx90a", None)
MI300_NO_AITER = Platform("cuda", True, "gfx942", "ModuleNotFoundError: No module named 'aiter'")
MI300 = Platform("cuda", True, "gfx942", None)
MI355 = Platform("cuda", True, "gfx950", None)
PLATFORMS = {"cpu": CPU, "nvidia": NVIDIA, "mi250": MI250, "mi300-no-aiter": MI300_NO_AITER, "mi300": MI300,
             "mi355": MI355}
WHY_NOT = {"cpu": "the device is the CPU", "nvidia": "this torch is a CUDA build", "mi250": "the GPU is gfx90a",
           "mi300-no-aiter": r"`import aiter` failed \(ModuleNotFoundError"}
LAYERS = [("mla", "target"), ("mla", "draft"), ("mha", "target"), ("mha", "draft")]


# ----------------------------------------------------------------------------- selection

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("request_", ["auto", "torch", "triton", "aiter"])
def test_attention_backend_for_every_platform_and_request(platform, request_):
    aiter_runs = platform in ("mi300", "mi355")
    for kind, role in LAYERS:
        if request_ in ("torch", "triton"):
            expected = request_
        elif request_ == "auto":
            expected = "torch" if platform == "cpu" else "aiter" if aiter_runs and kind == "mla" else "triton"
        elif not aiter_runs:
            with pytest.raises(ValueError, match=f"--attention-backend aiter is not available: {WHY_NOT[platform]}"):
                choose_backend(kind, role, request_, PLATFORMS[platform])
            continue
        elif kind == "mla":
            expected = "aiter"
        elif role == "draft":
            expected = "triton"  # never aiter's pa_* kernels (ROCm/ATOM#702)
        else:
            with pytest.raises(ValueError, match="serves MLA layers only"):
                choose_backend(kind, role, request_, PLATFORMS[platform])
            continue
        assert choose_backend(kind, role, request_, PLATFORMS[platform]) == expected, (kind, role)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("request_", ["auto", "torch", "triton", "aiter"])
def test_moe_backend_for_every_platform_and_request(platform, request_):
    aiter_runs = platform in ("mi300", "mi355")
    layers = {"kimi-like": (7168, 256, True), "tiny": (64, 32, True), "w4a16": (256, 256, False)}
    for layer, (hidden, inter, w4a4) in layers.items():
        fits = layer == "kimi-like"
        choose = lambda: choose_mxfp4_experts_backend(request_, PLATFORMS[platform], hidden, inter, w4a4)  # noqa: E731
        if request_ in ("torch", "triton"):
            assert choose() == request_
        elif request_ == "auto":
            assert choose() == ("torch" if platform == "cpu" else "aiter" if aiter_runs and fits else "triton"), layer
        elif not aiter_runs:
            with pytest.raises(ValueError, match=f"--moe-backend aiter is not available: {WHY_NOT[platform]}"):
                choose()
        elif fits:
            assert choose() == "aiter"
        else:
            why = "not a multiple of 256" if layer == "tiny" else "W4A16"
            with pytest.raises(ValueError, match=f"--moe-backend aiter cannot run these MXFP4 experts: .*{why}"):
                choose()


def test_asking_for_aiter_off_rocm_fails_at_start_up(monkeypatch):
    for flag in ("attention_backend", "moe_backend"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} aiter is not available: the device is the CPU"):
            EngineArgs(model="unused", **{flag: "aiter"})
    with pytest.raises(ValueError, match="--moe-backend must be one of auto, torch, triton, aiter; got 'ck'"):
        EngineArgs(model="unused", moe_backend="ck")
    # on a (pretend) MI355X the request passes, except for a model dtype aiter has no kernels for
    monkeypatch.setattr("atom_like.config.detect_platform", lambda device: MI355)
    EngineArgs(model="unused", attention_backend="aiter", moe_backend="aiter")
    with pytest.raises(ValueError, match="--attention-backend aiter runs bf16 models.*--dtype float32"):
        EngineArgs(model="unused", attention_backend="aiter", dtype="float32")


# ----------------------------------------------------------------------------- MLA decode

def test_metadata_is_aiter_csr_with_token_pages():
    block_tables = torch.tensor([[70_001, 3, 9], [65_536, 0, 0], [12, 65_537, 2]], dtype=torch.int32)
    context_lens = torch.tensor([9, 2, 5], dtype=torch.int32)
    md = mla_decode_metadata(torch.tensor([0, 2, 4, 6], dtype=torch.int32), context_lens, block_tables, 4, 2)
    expected = [block_tables[b, j // 4].item() * 4 + j % 4 for b in range(3) for j in range(context_lens[b])]
    assert md.kv_indptr.tolist() == [0, 9, 11, 16]
    assert md.kv_indices[:16].tolist() == expected and md.kv_indices.shape == (3 * 3 * 4,)
    assert md.kv_last_page_lens.tolist() == [1, 1, 1] and md.max_seqlen_q == 2
    assert all(t.dtype == torch.int32 for t in (md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_last_page_lens))


def mla_step(q_lens, ctx_lens, num_heads, kv_dtype, *, latent=64, rope=32, block_size=2, high_ids=True, seed=0):
    """Random queries and a random latent pool whose blocks (ids past 65,535 when `high_ids`) are
    scattered; returns q_latent, q_pe, cache, metadata, kv_scale (fp8 only)."""
    g = torch.Generator().manual_seed(seed)
    widths = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = (65_536 if high_ids else 0) + 4 * sum(widths)
    ids = (num_blocks - 1 - torch.randperm(4 * sum(widths), generator=g)[:sum(widths)]).tolist()
    tables = torch.zeros(len(q_lens), max(widths), dtype=torch.int32)
    for b, w in enumerate(widths):
        tables[b, :w] = torch.tensor(ids[sum(widths[:b]):sum(widths[:b + 1])])
    rows = torch.randn(num_blocks, block_size, latent + rope, generator=g)
    kv_scale = None
    if kv_dtype == torch.bfloat16:
        cache = rows.to(torch.bfloat16)
    else:
        kv_scale = torch.tensor([rows.abs().max().item() / 300.0])
        cache = quantize_fp8(rows, kv_scale, kv_dtype)
    tokens = sum(q_lens)
    q_latent = torch.randn(tokens, num_heads, latent, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(tokens, num_heads, rope, generator=g).to(torch.bfloat16)
    meta = AttentionMetadata(torch.tensor([0] + q_lens).cumsum(0).to(torch.int32), torch.tensor(ctx_lens, dtype=torch.int32),
                             tables, torch.full((tokens,), -1, dtype=torch.int64), max(q_lens), max(ctx_lens))
    return q_latent, q_pe, cache, meta, kv_scale


def fp8_query_roundtrip(q_latent, q_pe, dtype):
    """The queries as aiter's a8w8 kernels see them: per-tensor fp8 at scale amax / fp8 max."""
    q = torch.cat([q_latent, q_pe], dim=-1).float()
    scale = q.abs().max() / torch.finfo(dtype).max
    q = (q / scale).to(dtype).float() * scale
    return q[..., :q_latent.shape[-1]], q[..., q_latent.shape[-1]:]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("num_heads", [8, 40])  # 16: test_mla_at_kimi_dims
def test_mla_decode_through_emulated_aiter_is_the_reference(kv_dtype, q_len, num_heads):
    ctx_lens = [q_len + 37, q_len, q_len + 5, q_len + 1]  # mixed lengths, one with no history
    q_latent, q_pe, cache, meta, kv_scale = mla_step([q_len] * 4, ctx_lens, num_heads, kv_dtype, seed=q_len)
    emu = EmulatedAiter()
    backend = AiterMLABackend(emu, fallback=TorchMLABackend())
    scales = None if kv_scale is None else (kv_scale,)
    out = backend.attend_absorbed(q_latent, q_pe, cache, meta, 0.3, scales)
    if q_len == 3:  # no kernel promised for 3 rows: the fallback ran, aiter was never called
        assert emu.calls["mla_decode_fwd"] == 0
        torch.testing.assert_close(out, TorchMLABackend().attend_absorbed(q_latent, q_pe, cache, meta, 0.3, scales),
                                   rtol=0, atol=0)
        return
    assert emu.calls["mla_decode_fwd"] == math.ceil(num_heads / 16)  # 16-head groups, zero-padded
    seen = emu.mla_args[0]
    assert seen["q"].shape[1] == 16 and seen["sm_scale"] == 0.3 and seen["max_seqlen_q"] == q_len
    assert int(seen["kv_indices"][: sum(ctx_lens)].min()) >= 65_536 * 2  # token slots of blocks past 65,535
    if kv_dtype == torch.bfloat16:
        expected = torch_ref.mla_absorbed_attention(q_latent, q_pe, cache, meta, 0.3)
    else:
        assert seen["q"].dtype == kv_dtype and seen["kv_scale"] is kv_scale
        ql, qp = fp8_query_roundtrip(q_latent, q_pe, kv_dtype)
        expected = torch_ref.mla_absorbed_attention(ql, qp, cache, meta, 0.3, kv_scale)
    assert out.shape == q_latent.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_mla_at_kimi_dims_and_steps_aiter_cannot_take():
    q_latent, q_pe, cache, meta, _ = mla_step([4, 4], [9, 30], 16, torch.bfloat16, latent=512, rope=64,
                                              block_size=16, high_ids=False)
    emu = EmulatedAiter()
    backend = AiterMLABackend(emu, fallback=TorchMLABackend())
    out = backend.attend_absorbed(q_latent, q_pe, cache, meta, 576 ** -0.5)
    expected = torch_ref.mla_absorbed_attention(q_latent, q_pe, cache, meta, 576 ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    # the next layer of the step gets the same metadata object: converted once per step
    converted = backend._step[1]
    backend.attend_absorbed(q_latent, q_pe, cache, meta, 576 ** -0.5)
    assert backend._step[1] is converted and emu.calls["mla_decode_fwd"] == 2
    # mixed query lengths (aiter reads sequence b's rows at b * max_seqlen_q) and fp32 queries: fallback
    q_latent, q_pe, cache, meta, _ = mla_step([1, 4, 2], [5, 9, 3], 16, torch.bfloat16, high_ids=False)
    backend.attend_absorbed(q_latent, q_pe, cache, meta, 0.3)
    q_latent, q_pe, cache, meta, _ = mla_step([1, 1], [5, 9], 16, torch.bfloat16, high_ids=False)
    backend.attend_absorbed(q_latent.float(), q_pe.float(), cache.float(), meta, 0.3)
    assert emu.calls["mla_decode_fwd"] == 2  # neither reached aiter


# ----------------------------------------------------------------------------- MXFP4 MoE

def mxfp4_experts(num_experts, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = quantize_mxfp4(torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.05)
    w2, s2 = quantize_mxfp4(torch.randn(num_experts, hidden, inter, generator=g) * 0.05)
    return w13, s13, w2, s2


def test_shuffles_round_trip_and_move_bytes():
    emu = EmulatedAiter()
    w = torch.randint(0, 256, (3, 64, 128), dtype=torch.uint8)
    shuffled = emu.shuffle_weight(w[1])
    assert shuffled.is_shuffled and not torch.equal(shuffled, w[1])
    assert torch.equal(emu.unshuffle_weight(shuffled), w[1])
    # a byte's home: row 17, byte 53 = row block 1, column block 1, second 16-byte half, row 1, byte 5
    assert shuffled.flatten()[((1 * 4 + 1) * 2 + 1) * 256 + 1 * 16 + 5] == w[1, 17, 53]
    s = torch.randint(100, 140, (512, 16), dtype=torch.uint8)
    s_shuffled = emu.e8m0_shuffle(s)
    assert s_shuffled.shape == s.shape and not torch.equal(s_shuffled, s)
    assert torch.equal(emu.unshuffle_scale(s_shuffled, 512, 16), s)
    # row 53 = block 1, r2 1, r16 5; column 13 = block 1, c2 1, c4 1
    assert s_shuffled.flatten()[(((1 * 2 + 1) * 4 + 1) * 16 + 5) * 4 + 1 * 2 + 1] == s[53, 13]
    # shapes that are not multiples of (256, 8) come back padded, and undo to the original
    odd = torch.randint(100, 140, (40, 5), dtype=torch.uint8)
    assert emu.e8m0_shuffle(odd).shape == (256, 8)
    assert torch.equal(emu.unshuffle_scale(emu.e8m0_shuffle(odd), 40, 5), odd)


def test_mxfp4_moe_through_emulated_aiter_is_the_reference():
    num_experts, hidden, inter, tokens, top_k = 6, 256, 256, 9, 3
    w13, s13, w2, s2 = mxfp4_experts(num_experts, hidden, inter)
    originals = [t.clone() for t in (w13, s13, w2, s2)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])  # int64
    topk_weights = torch.rand(tokens, top_k, generator=g)
    emu = EmulatedAiter()
    moe = AiterMXFP4MoE(emu)
    with pytest.raises(RuntimeError, match="before their weights were shuffled"):
        moe(x, topk_weights, topk_ids)
    moe.shuffle_in_place(w13, s13, w2, s2)
    assert emu.calls["shuffle_weight"] == 2 * num_experts and emu.calls["e8m0_shuffle"] == 2
    for before, after in zip(originals, (w13, s13, w2, s2)):  # in place: same shapes, bytes moved
        assert after.shape == before.shape and not torch.equal(after, before)
    assert torch.equal(emu.unshuffle_weight(w13), originals[0])
    with pytest.raises(RuntimeError, match="already in aiter's layout"):
        moe.shuffle_in_place(w13, s13, w2, s2)
    out = moe(x, topk_weights, topk_ids)
    expected = fused_moe_mxfp4_reference(x.float(), *originals, topk_weights, topk_ids, quantize_activations=True)
    assert out.dtype == torch.bfloat16 and emu.calls["fused_moe"] == 1
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- the engine

@pytest.fixture
def pretend_mi355(monkeypatch):
    """This process as an MI355X with aiter installed, aiter being the emulation."""
    emu = EmulatedAiter()
    monkeypatch.setattr(aiter_ops, "import_aiter", lambda: emu)
    monkeypatch.setattr(backends, "import_aiter", lambda: emu)
    for module in ("atom_like.config", "model_ops.attention.backends", "model_ops.quant.mxfp4_layers"):
        monkeypatch.setattr(f"{module}.detect_platform", lambda device: MI355)
    return emu


@pytest.mark.parametrize("moe_backend, fused", [("auto", False), ("aiter", False), ("triton", True)])
def test_aiter_experts_keep_the_shared_expert_separate(pretend_mi355, moe_backend, fused):
    """A released MXFP4 config whose shared expert could be fused: aiter's routed experts (what
    auto picks on an MI355X with aiter) keep it a separate MLP, the adapter is not built for
    it; the Triton experts fuse it. Skeletons only."""
    from conftest import TINY_DEEPSEEK
    from transformers import DeepseekV3Config

    from atom_like.loader.quark import QuarkConfig, quantize_model
    from atom_like.models.deepseek_v2 import DeepseekV2MoE, DeepseekV3ForCausalLM
    from atom_like.zoo.quark_mxfp4 import EXCLUDES, quantization_config
    from model_ops.deferred import deferred_weights

    config = DeepseekV3Config(**{**TINY_DEEPSEEK, "hidden_size": 256, "moe_intermediate_size": 256})  # aiter's grain
    with deferred_weights():
        model = DeepseekV3ForCausalLM(config)
        quantize_model(model, QuarkConfig(quantization_config(EXCLUDES["released"])), model.weight_map(),
                       moe_backend=moe_backend)
    blocks = [m for m in model.modules() if isinstance(m, DeepseekV2MoE)]
    assert {m.experts.backend for m in blocks} == {"triton" if fused else "aiter"}
    assert all((m.shared_slot is not None, m.shared_experts is None) == (fused, fused) for m in blocks)


def test_engine_on_emulated_aiter(make_deepseek, tmp_path, pretend_mi355):
    """A tiny DeepSeek-V3 MXFP4 checkpoint in bf16. aiter's MLA for decode (1 row) and verify with
    3 drafts (4 rows): greedy tokens identical to the torch backend's (oracle drafts: lossless).
    Verify with 2 drafts (3 rows) never reaches aiter (the Triton fallback runs it). These runs
    keep activations unquantized (W4A16): with MXFP4 activations one rounding difference flips an
    fp4 code, and this random model's runs through any two attention implementations (torch and
    Triton included) part within a few tokens. aiter's MoE (W4A4 only): shuffled once per layer
    when loading finishes and run for every step; its tokens are not compared for the same reason,
    test_mxfp4_moe_through_emulated_aiter_is_the_reference compares the layer instead."""
    from atom_like import LLMEngine, SamplingParams
    from atom_like.zoo.quark_mxfp4 import convert
    from oracle_proposer import OracleProposer

    src = make_deepseek("v3", hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_hidden_layers=2,
                        n_routed_experts=4, n_group=2, topk_group=1)
    dst = str(convert(src, tmp_path / "mxfp4", style="experts_only", exclude_as="patterns"))
    prompts = [[3, 17, 42, 9, 100], list(range(5, 24))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_model_len=64, enforce_eager=True)
    w4a16 = dict(kw, moe_backend="torch", mxfp4_activations="unquantized")
    reference = [o.token_ids for o in LLMEngine(dst, attention_backend="torch", **w4a16)
                 .generate(prompts, params, use_tqdm=False)]
    continuations = {str(i): toks for i, toks in enumerate(reference)}
    emu = pretend_mi355
    for k, rows in ((0, 1), (3, 4), (2, 3)):
        emu.mla_args.clear()
        factory = None if k == 0 else (lambda r, k=k: OracleProposer(r, continuations, k))
        engine = LLMEngine(dst, attention_backend="aiter", proposer_factory=factory, **w4a16)
        assert all(isinstance(b.backend, AiterMLABackend) for b in engine.runner.builders)
        # 2 drafts only check the routing: one short request
        ids = [engine.add_request(p, params if rows != 3 else SamplingParams(temperature=0, max_tokens=3),
                                  request_id=str(i)) for i, p in enumerate(prompts if rows != 3 else prompts[:1])]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        seen = {a["max_seqlen_q"] for a in emu.mla_args}
        if rows == 3:
            assert rows not in seen, seen
        else:
            assert rows in seen and [done[i] for i in ids] == reference, (k, seen)

    engine = LLMEngine(dst, attention_backend="aiter", moe_backend="aiter", **kw)
    experts = [m for m in engine.runner.model.modules() if isinstance(m, mxfp4_layers.MXFP4Experts)]
    assert experts and all(m.backend == "aiter" for m in experts)
    assert emu.calls["e8m0_shuffle"] == 2 * len(experts)  # once per layer, when loading finished
    steps = emu.calls["fused_moe"]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == params.max_tokens for o in outs)
    assert emu.calls["fused_moe"] - steps == len(experts) * params.max_tokens  # every layer, every step
