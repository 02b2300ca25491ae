"""tiny-kimi-mxfp4: built from the shipped tiny-kimi by `prepare`; the zero-padding of the expert
intermediate size is exact; the released format loads packed; the shipped tiny-kimi drafts run
on it unchanged and stay lossless."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from atom_like import LLMEngine, SamplingParams
from atom_like.zoo import registry, resolve, tiny_kimi, tiny_kimi_mxfp4
from atom_like.zoo.checkpoint import load_tensors
from model_ops.quant.mxfp4_layers import MXFP4Experts, MXFP4Linear

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 200, 31, 77, 402, 5, 9], [1, 18, 4000, 12]]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    """`prepare tiny-kimi-mxfp4` into a fresh cache (calibrating on 2 conversations, not 32)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATOM_LIKE_CACHE", str(tmp_path_factory.mktemp("zoo_cache")))
        mp.setattr(tiny_kimi_mxfp4, "CALIBRATION_CHATS", 2)
        assert registry.locate("tiny-kimi-mxfp4") is None
        path = registry.prepare("tiny-kimi-mxfp4")
        assert registry.locate("tiny-kimi-mxfp4") == path
    return str(path)


def test_padding_the_expert_intermediate_size_is_exact():
    """The padded rows and columns are zeros, so the model computes the same function. Bit equality
    of the two models' logits is not what to ask: a BLAS may block a reduction over 112 and over 128
    differently (fp32 differed in the 6th digit on an AVX-512 CPU with MKL), so the models run in
    float64, where that rounding is ~1e-15 and any wrong padding (a shifted gate/up split, a padded
    hidden dim) is off by orders of magnitude more than the tolerance."""
    source = resolve("tiny-kimi")
    config = json.loads((source / "config.json").read_text())["text_config"]
    tensors = {k.removeprefix("language_model."): v for k, v in load_tensors(source).items()}
    padded = tiny_kimi_mxfp4.pad_intermediate(tensors, 128)
    for name, t in tensors.items():  # the original values untouched, the rest zeros
        p = padded[name]
        assert torch.equal(p[tuple(slice(0, n) for n in t.shape)], t), name
        assert p.count_nonzero() == t.count_nonzero(), name
    ids = torch.tensor([[1, 200, 31, 77, 402, 5, 9, 1000, 17]])
    logits = []
    for state, inter in ((tensors, 112), (padded, 128)):
        model = tiny_kimi.build_model(dict(config, moe_intermediate_size=inter)).double().eval()
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
        model.load_state_dict(tiny_kimi.from_checkpoint_tensors({f"language_model.{k}": v for k, v in state.items()}))
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert logits[0].dtype == torch.float64 and logits[0].abs().max() > 1
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)


def test_released_format_and_kv_scales(built):
    manifest = json.loads(open(f"{built}/zoo.json").read())
    quant = json.loads(open(f"{built}/config.json").read())["quantization_config"]
    assert quant["quant_method"] == "quark"
    assert quant["export"]["kv_cache_group"] == ["*kv_a_proj_with_mqa", "*kv_b_proj"]
    assert all(".self_attn." in n or n.endswith("lm_head") for n in quant["exclude"])
    with safe_open(f"{built}/model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("language_model.model.layers.1.mlp.experts.7.down_proj.weight").shape == (256, 64)
        assert f.get_tensor("language_model.model.layers.1.mlp.experts.7.down_proj.weight_scale").shape == (256, 4)
        scale = f.get_tensor("language_model.model.layers.2.self_attn.kv_a_proj_with_mqa.output_scale").item()
    assert scale == pytest.approx(manifest["kv_scales"]["language_model.model.layers.2.self_attn"], rel=1e-5)
    assert "language_model.model.layers.0.mlp.gate_proj.weight_scale" in keys  # dense layer-0 MLP: MXFP4
    assert "language_model.model.layers.0.self_attn.q_b_proj.weight_scale" not in keys  # MLA: bf16
    assert manifest["bytes"] < 0.75 * sum(p.stat().st_size for p in resolve("tiny-kimi").glob("*.safetensors"))


@pytest.mark.parametrize("draft", ["tiny-kimi-eagle3", "tiny-kimi-eagle3.1-mla"])  # MHA; MLA with EAGLE3.1 flags
def test_shipped_drafts_run_on_it_losslessly(built, draft):
    plain = LLMEngine(built, max_model_len=256, kv_cache_dtype="fp8")
    modules = list(plain.runner.model.modules())
    experts = [m for m in modules if isinstance(m, MXFP4Experts)]
    assert len(experts) == 4 and all(m.num_experts == 8 + 1 for m in experts)  # the shared expert fused in
    assert sum(isinstance(m, MXFP4Linear) for m in modules) == 2  # dense gate_up + down
    assert plain.runner.kv_caches["kv_scale"].flatten().tolist() != [1.0] * 5  # the checkpoint's scales
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    spec = LLMEngine(built, max_model_len=256, kv_cache_dtype="fp8", method="eagle3", draft_model=str(resolve(draft)),
                     num_speculative_tokens=3)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert spec.scheduler.spec_stats.num_accepted_tokens > 0
