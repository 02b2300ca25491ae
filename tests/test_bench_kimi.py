"""ci/bench_kimi.py's build path at tiny width (the same config writer, the same LLMEngine build,
dims scaled down): `--load-format dummy` builds from config.json alone; a simulated rank r of N
holds exactly its slice (heads / N, experts' intermediate / N, vocab / N) and runs; N ranks'
partial outputs, before the all-reduce, sum to the single-rank output (fp32, the weights cut by the
loader's real tensor-parallel slicing); the collectives on paper are the ones the engine runs."""
from __future__ import annotations

import json
import sys
from fractions import Fraction
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ci"))
import bench_kimi  # noqa: E402
from bench_kimi import TINY, acceptance_schedule, build_engine, collectives_per_step, write_configs  # noqa: E402

from atom_like import LLMEngine, SamplingParams  # noqa: E402
from atom_like.engine.step_inputs import host_step, upload  # noqa: E402
from model_ops import tp  # noqa: E402
from model_ops.quant.mxfp4 import dequantize_mxfp4  # noqa: E402
from model_ops.quant.mxfp4_layers import MXFP4Experts  # noqa: E402

N = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
COMMON = dict(max_model_len=64, max_num_seqs=4, num_kv_blocks=32, enforce_eager=True)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> tuple[str, str]:
    return write_configs(tmp_path_factory.mktemp("kimi"), TINY)


def text_model(engine: LLMEngine):
    return engine.runner.model.language_model


def test_dummy_builds_from_config_alone_seeded_with_mxfp4_sane_and_generates(configs):
    target, draft = configs
    assert sorted(p.name for p in Path(target).iterdir()) == ["config.json"]
    engine, _ = build_engine(target, draft, 3, load_format="dummy", kv_cache_dtype="fp8", **COMMON)
    prompts = [[5, 6, 7, 8], [9, 10]]
    out = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    assert all(len(t) == 6 for t in out)
    model = text_model(engine)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, MXFP4Experts)
    rms = dequantize_mxfp4(experts.w13.data, experts.w13_scale.data).pow(2).mean().sqrt().item()
    assert 0.01 < rms < 0.05, rms
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    std = model.lm_head.weight.std().item()
    assert 0.015 < std < 0.025, std
    draft_model = engine.runner.proposer.draft
    assert 0.015 < draft_model.fc.weight.std().item() < 0.025
    # seeded: the same seed gives the same weights (and tokens), another seed other weights
    again = LLMEngine(target, load_format="dummy", kv_cache_dtype="fp8", **COMMON)
    assert torch.equal(text_model(again).model.layers[1].mlp.experts.w2, experts.w2)
    other = LLMEngine(target, load_format="dummy", seed=1, **COMMON)
    assert not torch.equal(text_model(other).model.layers[1].mlp.experts.w2, experts.w2)
    # the default format still reads the checkpoint's files, and says they are missing
    with pytest.raises(ValueError, match="has no weight file"):
        LLMEngine(target, **COMMON)
    with pytest.raises(ValueError, match="--load-format must be one of auto, dummy"):
        LLMEngine(target, load_format="random", **COMMON)


def test_a_simulated_rank_holds_its_slice_and_runs(configs):
    target, draft = configs
    d = TINY
    with tp.tp_state(2, N, simulated=True):
        engine, _ = build_engine(target, draft, 3, load_format="dummy", kv_cache_dtype="fp8", **COMMON)
        out = engine.generate([[1, 2, 3, 4, 5]], GREEDY, use_tqdm=False)[0].token_ids
    assert len(out) == 6
    model = text_model(engine)
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.num_heads == d.heads // N
    assert attn.q_b_proj.weight.shape == (d.heads // N * (d.nope + d.rope), d.q_lora)
    assert attn.o_proj.weight.shape == (d.hidden, d.heads // N * d.v_head)
    assert attn.kv_b_proj.weight.shape == (d.heads // N * (d.nope + d.v_head), d.kv_lora)
    assert attn.fused_qkv_a_proj_with_mqa.weight.shape == (d.q_lora + d.kv_lora + d.rope, d.hidden)  # replicated
    inter = d.moe_intermediate // N
    # the MXFP4 shared expert is fused into the routed experts as one more expert (index d.experts)
    assert moe.shared_experts is None and moe.shared_slot == d.experts
    assert moe.experts.w13.shape == (d.experts + 1, 2 * inter, d.hidden // 2)  # packed FP4: two a byte
    assert moe.experts.w2.shape == (d.experts + 1, d.hidden, inter // 2)
    assert moe.experts.w2_scale.shape == (d.experts + 1, d.hidden, inter // 32)
    # the roofline's routed bytes are the routed experts' only: the fused shared slot is read every step
    per_expert = sum(t[0].numel() for t in (moe.experts.w13, moe.experts.w13_scale, moe.experts.w2,
                                            moe.experts.w2_scale))  # uint8: a byte an element
    weights = bench_kimi.rank_weights(engine.runner)
    assert weights["routed"] == weights["moe_layers"] * d.experts * per_expert
    assert moe.gate.weight.shape == (d.experts, d.hidden)  # the router is replicated
    dense = model.model.layers[0].mlp
    assert dense.down_proj.weight.shape == (d.hidden, d.dense_intermediate // N // 2)
    assert model.model.embed_tokens.weight.shape == model.lm_head.weight.shape == (d.vocab // N, d.hidden)
    drafter = engine.runner.proposer.draft
    assert drafter.midlayer.self_attn.qkv_proj.weight.shape == (3 * d.draft_heads // N * d.draft_head_dim, 2 * d.hidden)
    assert drafter.midlayer.mlp.down_proj.weight.shape == (d.hidden, d.draft_intermediate // N)
    assert drafter.fc.weight.shape == (d.hidden, 3 * d.hidden)  # replicated
    assert drafter.lm_head.weight.shape == (d.vocab // N, d.hidden)


def test_simulated_collectives_keep_shapes_and_move_nothing():
    x = torch.arange(6.0).view(2, 3)
    with tp.tp_state(1, 4, simulated=True):
        assert tp.all_reduce(x) is x
        assert torch.equal(tp.all_gather(x, dim=-1), torch.cat([x] * 4, dim=-1))
        assert tp.all_gather(x, dim=0).shape == (8, 3)
        assert tp.agree_min(7) == 7
    assert not tp.state().simulated  # only inside the context
    with pytest.raises(ValueError, match="simulated tensor-parallel rank has no process group"):
        tp.set_state(tp.TPState(0, 2, object(), simulated=True))


@pytest.fixture(scope="module")
def ranks(configs, tmp_path_factory):
    """(the size-1 model, [rank r of N]), fp32: the size-1 model's dummy weights written as a
    checkpoint (engine names: fused and stacked tensors load whole), each rank loading its slices."""
    target, _ = configs
    folder = tmp_path_factory.mktemp("kimi_ckpt")
    (folder / "config.json").write_text(Path(target, "config.json").read_text())
    full = LLMEngine(str(target), load_format="dummy", **COMMON)
    weights = {n: p.detach().clone() for n, p in full.runner.model.named_parameters()}
    save_file(weights, str(folder / "model.safetensors"))
    engines = []
    for r in range(N):
        with tp.tp_state(r, N, simulated=True):
            engines.append(LLMEngine(str(folder), **COMMON))
    return full, engines


def prefill_meta(engine: LLMEngine, tokens: int):
    """One sequence prefilling `tokens` tokens into blocks 0.. of `engine`'s pool."""
    blocks = list(range(-(-tokens // engine.args.block_size)))
    ids = np.random.default_rng(0).integers(0, TINY.vocab, tokens)
    return upload(host_step([ids], [0], [blocks], [[tokens - 1]], engine.args.block_size), torch.device("cpu"))


def test_n_ranks_partial_outputs_sum_to_the_single_rank_output(ranks):
    full, engines = ranks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, TINY.hidden, generator=g)
    step = prefill_meta(full, 7)

    def per_rank(fn, *extra):
        outs = []
        for r, e in enumerate(engines):
            with tp.tp_state(r, N, simulated=True):  # all-reduces return this rank's partial sum
                outs.append(fn(text_model(e), *extra))
        return outs

    def attention(m):
        cos_sin = m.model.rotary.cos_sin(step.positions, x.dtype)
        return m.model.layers[1].self_attn(x, cos_sin, step.meta)

    blocks = {
        "embedding": lambda m: m.model.embed_tokens(step.input_ids),
        "MLA attention + o_proj": attention,
        "MoE (routed + shared experts)": lambda m: m.model.layers[1].mlp(x),
        "dense MLP (layer 0)": lambda m: m.model.layers[0].mlp(x),
    }
    for name, fn in blocks.items():
        whole = fn(text_model(full))
        parts = per_rank(fn)
        assert all(p.shape == whole.shape for p in parts), name
        torch.testing.assert_close(sum(parts), whole, rtol=1e-4, atol=1e-5, msg=name)
        assert not torch.allclose(parts[0], whole, rtol=1e-2, atol=1e-3), f"{name}: one rank alone is not the sum"
    # o_proj alone: each rank's input is its heads' columns of the attention output
    v = torch.randn(7, TINY.heads * TINY.v_head, generator=g)
    cols = TINY.heads * TINY.v_head // N
    parts = [None] * N
    for r, e in enumerate(engines):
        with tp.tp_state(r, N, simulated=True):
            parts[r] = text_model(e).model.layers[2].self_attn.o_proj(v[:, r * cols:(r + 1) * cols])
    torch.testing.assert_close(sum(parts), text_model(full).model.layers[2].self_attn.o_proj(v), rtol=1e-4, atol=1e-5)
    # the LM head: a simulated all-gather gives the full width, each rank's vocab slice in place of all
    whole = text_model(full).compute_logits(x)
    rows = TINY.vocab // N
    for r, logits in enumerate(per_rank(lambda m: m.compute_logits(x))):
        assert logits.shape == whole.shape
        torch.testing.assert_close(logits[:, :rows], whole[:, r * rows:(r + 1) * rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [0, 3])
def test_the_collectives_on_paper_are_the_engines(configs, monkeypatch, k):
    """One decode step of a simulated rank at batch 2, counted at model_ops.tp."""
    target, draft = configs
    seen = {"all_reduce": [], "all_gather": []}
    with tp.tp_state(0, N, simulated=True):
        engine, forced = build_engine(target, draft if k else None, k, load_format="dummy", **COMMON)
        for p in ([1, 2, 3], [4, 5, 6, 7]):
            engine.add_request(p, GREEDY)
        for _ in range(2):  # prefill, then a first decode step (the drafts' first proposals)
            engine.step()
        for op in seen:
            def counted(t, _real=getattr(tp, op), _op=op, **kw):
                seen[_op].append(t.numel() * 2)
                return _real(t, **kw)

            monkeypatch.setattr(tp, op, counted)
        engine.step()
    paper = collectives_per_step(TINY, 2, k, N)
    assert len(seen["all_reduce"]) == paper["all_reduces"] and len(seen["all_gather"]) == paper["all_gathers"]
    assert sum(seen["all_reduce"]) == paper["all_reduce_bytes"]  # bf16 on the GPU: 2 bytes an element
    assert sum(seen["all_gather"]) * N == paper["all_gather_bytes"]  # a rank sends 1/N of the gathered tensor


@pytest.mark.parametrize("k, length, mix", [(3, "2.88", {1: 3, 2: 22}), (4, "3.24", {2: 19, 3: 6})])
def test_the_forced_acceptance_mix_averages_the_reference_exactly(k, length, mix):
    schedule = list(islice(acceptance_schedule(Fraction(length), k), 3, 3 + 25))  # any 25 consecutive steps
    assert Fraction(sum(schedule), 25) + 1 == Fraction(length)
    assert {m: schedule.count(m) for m in set(schedule)} == mix


def test_the_bench_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    # a chunk budget of 16 prefills the 3 prompts in 3 steps, the first decoding meanwhile: every
    # window step must still give every user a token (it once ran out of max_tokens inside the window)
    result = bench_kimi.main(["--tiny", "--device", "cpu", "--ks", "0,3", "--concurrency", "3", "--input-len", "12",
                              "--output-len", "16", "--window", "2", "--warmup", "1", "--copy-bytes", str(1 << 20),
                              "--max-num-batched-tokens", "16"])
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [("off", 3), ("k=3", 3)]
    assert [w["tokens_per_step"] for w in result["rows"][0]["windows"]] == [1.0, 1.0]
    near, far = result["rows"][1]["windows"]
    assert near["prompt_len"] == 12 and far["context"] > near["context"] + 4  # the second window runs further in
    assert all(r["tokens_per_s_user"] > 0 and r["roofline_ms"] > 0 for r in result["rows"])
    assert json.loads((tmp_path / "bench_kimi.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert "| k=3 | 3 |" in (tmp_path / "bench_kimi.md").read_text()
    assert (tmp_path / "bench_kimi.png").stat().st_size > 1000
