"""FP8 (e4m3) KV cache: the torch reference's rounding checked independently, per-tensor scales
from the checkpoint (else 1.0 and one warning), the fp8 pools and scale tensors of the target and
of EAGLE3 drafts, and speculation over an fp8 cache staying lossless."""
from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_attention_reference import random_batch
from test_llama_parity import PROMPTS

from atom_like import LLMEngine, SamplingParams
from model_ops.attention import torch_ref
from model_ops.attention.metadata import AttentionMetadata
from model_ops.quant.fp8 import quantize_fp8

E4M3 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3fn value (ties to even) by enumerating all 256 codes; saturate."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    grid = codes[codes.isfinite()].unique().to(x.device)  # sorted, -448 .. 448
    x = x.clamp(-448, 448)
    hi = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    hi_even = (hi_v.to(E4M3).view(torch.uint8) & 1) == 0  # grid values convert exactly: their codes
    pick_hi = (hi_v - x < x - lo_v) | ((hi_v - x == x - lo_v) & hi_even)
    return torch.where(pick_hi, hi_v, lo_v)


def test_write_rounds_to_nearest_e4m3_and_saturates():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 2, 8, generator=g) * 30
    values[0, 0, 0], values[1, 1, 1] = 5000.0, -1e9  # beyond the range: saturate, never NaN
    scale = torch.tensor([0.37])
    cache = torch.zeros(4, 2, 2, 8, dtype=E4M3)
    slots = torch.tensor([0, 3, 4, -1, 6, 7])  # -1: a padding row, not written
    torch_ref.write_cache(cache, values, slots, scale)
    stored = cache.flatten(0, 1).float()
    keep = slots >= 0
    # independent reference: nearest representable e4m3 value of x / scale (the grid's ties)
    assert torch.equal(stored[slots[keep]], e4m3_round(values[keep] / scale))
    assert stored[0, 0, 0] == 448 and stored[3, 1, 1] == -448
    assert not stored.isnan().any() and stored[1].abs().sum() == 0  # untouched slot (row 3's -1)


def _meta(lens: list[int], block_size: int) -> AttentionMetadata:
    blocks = [-(-n // block_size) for n in lens]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.arange(start, start + n)
        start += n
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = [torch.arange(n) for n in lens]
    slots = torch.cat([tables[i, p // block_size].long() * block_size + p % block_size for i, p in enumerate(pos)])
    return AttentionMetadata(query_start_loc=qsl, context_lens=torch.tensor(lens, dtype=torch.int32),
                             block_tables=tables, slot_mapping=slots, max_query_len=max(lens),
                             max_context_len=max(lens))


def test_fp8_reads_equal_a_float_cache_of_the_dequantized_values():
    """Attention over an fp8 cache == attention over a float cache holding entry * scale, for MHA
    (K and V scales) and both MLA forms (one scale for the 576-style row), every row read from the
    cache (MLA's expanded form given no `fresh` rows: see the next test for what a layer passes)."""
    g = torch.Generator().manual_seed(1)
    meta = _meta([5, 11], block_size=4)
    t = 16
    k, v, q = (torch.randn(t, 2, 8, generator=g) * 3 for _ in range(3))
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.02])
    fp8 = torch.zeros(2, 8, 4, 2, 8, dtype=E4M3)
    torch_ref.write_cache(fp8[0], k, meta.slot_mapping, k_scale)
    torch_ref.write_cache(fp8[1], v, meta.slot_mapping, v_scale)
    dense = torch.stack([fp8[0].float() * k_scale, fp8[1].float() * v_scale])
    got = torch_ref.paged_attention(q, fp8[0], fp8[1], meta, 0.3, k_scale, v_scale)
    assert torch.equal(got, torch_ref.paged_attention(q, dense[0], dense[1], meta, 0.3))

    latent, q_lat = torch.randn(t, 12, generator=g), torch.randn(t, 3, 8, generator=g)
    q_pe = torch.randn(t, 3, 4, generator=g)
    scale = torch.tensor([0.01])
    rows = torch.zeros(8, 4, 12, dtype=E4M3)
    torch_ref.write_cache(rows, latent, meta.slot_mapping, scale)
    dense_rows = rows.float() * scale
    assert torch.equal(torch_ref.mla_absorbed_attention(q_lat, q_pe, rows, meta, 0.2, scale),
                       torch_ref.mla_absorbed_attention(q_lat, q_pe, dense_rows, meta, 0.2))
    w = torch.randn(3 * 14, 8, generator=g)

    def expand(x):
        kv = (x @ w.T).view(*x.shape[:-1], 3, 14)
        return kv[..., :6], kv[..., 6:]

    q_nope = torch.randn(t, 3, 6, generator=g)
    assert torch.equal(torch_ref.mla_expanded_attention(q_nope, q_pe, rows, meta, 0.2, expand, scale),
                       torch_ref.mla_expanded_attention(q_nope, q_pe, dense_rows, meta, 0.2, expand))


def _expander(heads: int, latent: int, nope: int, v: int, g: torch.Generator):
    w = torch.randn(heads * (nope + v), latent, generator=g) * 0.3

    def expand(x):
        kv = (x @ w.T).view(*x.shape[:-1], heads, nope + v)
        return kv[..., :nope], kv[..., nope:]
    return expand


@pytest.mark.parametrize("budget", [torch_ref.SCORE_BUDGET, 20])
@pytest.mark.parametrize("prompts_only", [False, True], ids=["mixed", "prompts"])
def test_expanded_mla_attends_the_steps_rows_unquantized(monkeypatch, budget, prompts_only):
    """Expanded MLA over an fp8 cache with `fresh` rows == the same attention over a float cache that
    holds the fresh rows at the step's own tokens and the dequantized entries for earlier context.
    Sequences: a whole prompt, chunks over earlier context (prefix hit / earlier chunk), a lone row
    in a mixed batch; or whole prompts only, whose groups read nothing from the cache (`from_step`).
    A score budget of 20 cuts them into one-row segments, a group holding two segments of one
    sequence, and the mixed batch into groups of both kinds."""
    g = torch.Generator().manual_seed(3)
    heads, latent, rope, nope, v = 3, 12, 4, 6, 5
    ctx, qlen = ([5, 11, 9], [5, 11, 9]) if prompts_only else ([5, 11, 9, 23], [5, 4, 1, 13])
    meta = random_batch(ctx, qlen, 24, 4, g)
    groups = list(torch_ref.segment_groups(meta, heads, budget))
    from_step = {x.from_step for x in groups}
    assert from_step == ({True} if prompts_only else {True, False} if budget == 20 else {False})
    if budget != torch_ref.SCORE_BUDGET:  # the cut this case is for
        assert any(len(x.seqs.unique()) < len(x.seqs) for x in groups)
    original = torch_ref.segment_groups
    monkeypatch.setattr(torch_ref, "segment_groups", lambda m, n: original(m, n, budget))
    scale = torch.tensor([0.02])
    fp8 = quantize_fp8(torch.randn(24, 4, latent + rope, generator=g), scale, E4M3)  # earlier context
    t = sum(qlen)
    fresh = torch.cat([torch.randn(t, latent, generator=g) * 2, torch.randn(t, rope, generator=g) * 2], -1)
    torch_ref.write_cache(fp8, fresh, meta.slot_mapping, scale)  # the layer writes, then attends
    dense = fp8.float() * scale
    torch_ref.write_cache(dense, fresh, meta.slot_mapping)
    q_nope, q_pe = torch.randn(t, heads, nope, generator=g), torch.randn(t, heads, rope, generator=g)
    expand = _expander(heads, latent, nope, v, g)

    got = torch_ref.mla_expanded_attention(q_nope, q_pe, fp8, meta, 0.3, expand, scale, fresh)
    assert torch.equal(got, torch_ref.mla_expanded_attention(q_nope, q_pe, dense, meta, 0.3, expand))
    # not the old rule: the step's rows read back through fp8 give other numbers
    assert not torch.allclose(got, torch_ref.mla_expanded_attention(q_nope, q_pe, fp8, meta, 0.3, expand, scale),
                              rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mla_layer_prefill_reads_only_earlier_context_through_fp8(backend):
    """The layer (kv_a_layernorm and RoPE riding along the write, as DeepseekV2Attention calls it)
    over an fp8 cache: the expanded form equals the layer over a float cache holding the dequantized
    earlier context, the rows it writes being the normalized, rotated step rows; the absorbed form
    (decode / verify) still reads the step's own rows back through fp8. The Triton backend writes
    with its fused kernel (interpreter on CPU) and inherits the reference's expanded form."""
    from test_mla import BLOCK_SIZE, HEADS, LATENT, NOPE, NUM_BLOCKS, ROPE, make_layer
    from transformers import LlamaConfig

    from model_ops.attention.backends import TorchMLABackend, TritonMLABackend, mla_row_values
    from model_ops.layernorm import RMSNorm
    from model_ops.rotary import RotaryEmbedding

    if backend == "triton" and importlib.util.find_spec("kernels_rocm.rope_kv_cache") is None:
        pytest.skip("needs kernels_rocm (Triton)")
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors: the Triton kernels take them only in the interpreter (tests/conftest.py)")
    g = torch.Generator().manual_seed(4)
    ctx, qlen = [37, 20, 9], [37, 18, 1]  # a prompt, a chunk over a cached prefix, a decode row
    meta = random_batch(ctx, qlen, NUM_BLOCKS, BLOCK_SIZE, g)
    layer = make_layer(g)
    ref = copy.deepcopy(layer)  # the same kv_b_proj, bound to a float cache
    norm = RMSNorm(LATENT)
    norm.weight.copy_(torch.rand(LATENT, generator=g) + 0.5)
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2), ROPE, interleaved=True)
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(ctx, qlen)])
    rope = (rotary, rotary.cos_sin(positions, torch.float32))
    scale = torch.tensor([0.05])
    old = quantize_fp8(torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT + ROPE, generator=g), scale, E4M3)
    t = sum(qlen)
    q_nope, q_pe = torch.randn(t, HEADS, NOPE, generator=g), torch.randn(t, HEADS, ROPE, generator=g)
    latent, k_pe = torch.randn(t, LATENT, generator=g) * 3, torch.randn(t, ROPE, generator=g)
    layer.bind_kv_cache(old.clone(), TorchMLABackend() if backend == "torch" else TritonMLABackend(), (scale,))
    ref.bind_kv_cache(old.float() * scale, TorchMLABackend())
    args = (q_nope, q_pe, latent, k_pe, meta)

    expanded = layer.attend(*args, absorbed=False, rope=rope, latent_norm=norm)
    expected = ref.attend(*args, absorbed=False, rope=rope, latent_norm=norm)
    if backend == "torch":
        assert torch.equal(expanded, expected)
    else:  # q_pe rotated by the kernel: fp32 rounding apart
        torch.testing.assert_close(expanded, expected, rtol=1e-5, atol=1e-5)
    if backend == "torch":  # the rows written are the ones attended unquantized, rounded to fp8
        rows = torch.cat(mla_row_values((latent, k_pe), norm, rope), -1)
        assert torch.equal(layer.kv_cache.flatten(0, 1)[meta.slot_mapping], quantize_fp8(rows, scale, E4M3))
    # decode / verify: every row, the step's own included, as the fp8 cache holds it
    absorbed = layer.attend(*args, absorbed=True, rope=rope, latent_norm=norm)
    seen = layer.kv_cache.flatten(0, 1)[meta.slot_mapping].float() * scale
    expected = ref.attend(q_nope, rotary.apply(q_pe, *rope[1]), seen[:, :LATENT], seen[:, LATENT:], meta, absorbed=True)
    torch.testing.assert_close(absorbed, expected, rtol=1e-5, atol=1e-5)


def test_scale_and_cache_dtype_must_agree():
    meta = _meta([3], block_size=4)
    x = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match=r"scale: the cache is torch.float8_e4m3fn but no scale was given"):
        torch_ref.write_cache(torch.zeros(1, 4, 2, 8, dtype=E4M3), x, meta.slot_mapping)
    with pytest.raises(ValueError, match=r"k_scale was given but the cache is torch.float32, not fp8"):
        cache = torch.zeros(1, 4, 2, 8)
        torch_ref.paged_attention(x, cache, cache, meta, 0.3, torch.tensor([1.0]), None)


@pytest.fixture(scope="module")
def deepseek(make_deepseek) -> str:
    return make_deepseek("v3")


def with_kv_scales(src: str, dst, scales: dict[str, float]) -> str:
    path = shutil.copytree(src, dst)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def test_engine_fp8_cache_uses_checkpoint_scales_and_rounds_like_the_reference(deepseek, tmp_path, caplog):
    """Layer 0's latent rows of a prefill, stored by the fp8 engine, equal the reference rounding of
    the rows the unquantized engine stores, with the checkpoint's scale (the larger of Quark's
    kv_a_proj_with_mqa / kv_b_proj output scales); layers without one get 1.0 and one warning."""
    attn = "model.layers.0.self_attn"
    path = with_kv_scales(deepseek, tmp_path / "scaled", {f"{attn}.kv_a_proj_with_mqa.output_scale": 0.004,
                                                          f"{attn}.kv_b_proj.output_scale": 0.005})
    prompt = PROMPTS[3]
    ref = LLMEngine(path, max_model_len=128, enforce_eager=True)
    ref.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    with caplog.at_level(logging.WARNING, logger="atom_like.loader.kv_scales"):
        fp8 = LLMEngine(path, max_model_len=128, kv_cache_dtype="fp8", enforce_eager=True)
    warnings = [r.getMessage() for r in caplog.records if "KV-cache scale" in r.getMessage()]
    assert len(warnings) == 1 and "for 2 of 3 cache tensors; using 1.0" in warnings[0]
    scales = fp8.runner.kv_caches["kv_scale"]
    assert scales.dtype == torch.float32 and scales.flatten().tolist() == pytest.approx([0.005, 1.0, 1.0])
    fp8.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    pool, ref_pool = fp8.runner.kv_caches["kv_cache"], ref.runner.kv_caches["kv_cache"]
    assert pool.dtype == E4M3
    rows = slice(0, len(prompt))  # the first blocks hold the prompt (one sequence, fresh pool)
    stored = pool[0].flatten(0, 1)[rows].float()
    assert torch.equal(stored, e4m3_round(ref_pool[0].flatten(0, 1)[rows].float() / 0.005))  # bf16 on a GPU: divide in fp32
    # an fp8 block holds a quarter of an fp32 block's bytes
    assert ref.runner.block_bytes == 4 * fp8.runner.block_bytes


def _prompt_logprobs(engine: LLMEngine, prompt: list[int]) -> list[float]:
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


# "auto" is the torch reference on CPU and Triton on a GPU; "triton" on CPU runs its write kernel in
# the interpreter, whose rows (`rows_out`) the fp8 prefill attends
BACKENDS = pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the GPU's auto is Triton"))])


@BACKENDS
def test_fp8_prefill_attends_its_own_tokens_unquantized(deepseek, backend):
    """A prompt prefilled in one step scores exactly as with a float cache (fp32 both): every MLA
    layer attends the step's own rows at model precision, only earlier context goes through fp8
    (vLLM's and SGLang's MLA prefill). Cut into chunks of 24 (each > ABSORBED_MAX_QUERY_LEN rows, so
    expanded too), the first chunk still scores as the float engine's same chunk, and later
    chunks, which read the earlier ones back through fp8, do not. On a GPU this holds only because
    the step's rows come from the write kernel itself: rows made again in torch round apart from
    the kernel's by an fp32 ulp, which this random MoE's routing turned into logprob changes of 1e-3."""
    prompt = PROMPTS[3]  # 77 tokens
    kw = dict(max_model_len=128, enforce_eager=True, attention_backend=backend)
    whole = _prompt_logprobs(LLMEngine(deepseek, **kw), prompt)
    assert _prompt_logprobs(LLMEngine(deepseek, kv_cache_dtype="fp8", **kw), prompt) == whole
    chunked = _prompt_logprobs(LLMEngine(deepseek, max_num_batched_tokens=24, **kw), prompt)
    fp8_chunked = _prompt_logprobs(LLMEngine(deepseek, kv_cache_dtype="fp8", max_num_batched_tokens=24, **kw), prompt)
    assert fp8_chunked[:24] == chunked[:24]
    assert all(a != b for a, b in zip(fp8_chunked[24:], chunked[24:]))


@BACKENDS
def test_fp8_prefill_after_a_prefix_cache_hit_reads_the_hit_through_fp8(deepseek, backend):
    """A prompt whose first 48 tokens hit the prefix cache prefills its 29 other tokens (expanded)
    over the cached 48 as the fp8 cache holds them: its first token's logprob moves away from the
    float engine's (same schedule), while the same prompt without the hit matches it exactly."""
    prompt, params = PROMPTS[3], SamplingParams(temperature=0, max_tokens=1, logprobs=0)

    def first_logprob(kv: str, warm: bool) -> float:
        engine = LLMEngine(deepseek, max_model_len=128, enforce_eager=True, kv_cache_dtype=kv,
                           attention_backend=backend)
        if warm:
            engine.generate([prompt[:48]], params, use_tqdm=False)
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        assert engine.block_manager.num_hit_tokens == (48 if warm else 0)
        return out.logprobs[0].logprob

    assert first_logprob("fp8", warm=False) == first_logprob("auto", warm=False)
    hit, float_hit = first_logprob("fp8", warm=True), first_logprob("auto", warm=True)
    assert hit != float_hit


@pytest.mark.parametrize("draft", ["mha", "mla"])
def test_fp8_target_and_draft_stay_lossless(deepseek, make_eagle3_llama, make_eagle3_mla, draft):
    path = (make_eagle3_llama(deepseek, aux_layer_ids=[0, 1, 2]) if draft == "mha"
            else make_eagle3_mla(deepseek, aux_layer_ids=(0, 1, 2)))
    plain = LLMEngine(deepseek, max_model_len=128, kv_cache_dtype="fp8")
    spec = LLMEngine(deepseek, max_model_len=128, kv_cache_dtype="fp8_e4m3", method="eagle3", draft_model=path)
    caches = spec.runner.kv_caches
    assert caches["kv_cache"].dtype == caches["eagle3_kv_cache"].dtype == E4M3
    assert caches["eagle3_kv_scale"].shape == ((1, 2) if draft == "mha" else (1, 1))  # K and V, or the latent row
    expected = [o.token_ids for o in plain.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in spec.generate(PROMPTS[:3], GREEDY, use_tqdm=False)] == expected
    assert spec.scheduler.spec_stats.num_drafts > 0


def test_fp8_llama_target(make_llama):
    """MHA targets: K and V pools in e4m3 with a K and a V scale per layer; decodes normally."""
    engine = LLMEngine(make_llama(), max_model_len=128, kv_cache_dtype="fp8")
    assert engine.runner.kv_caches["kv_scale"].shape == (2, 2)
    outs = engine.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
