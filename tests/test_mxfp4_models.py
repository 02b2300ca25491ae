"""Quark MXFP4 checkpoints against transformers' own models (fp32, CPU): greedy tokens identical.

Random-init DeepSeek-V3 and Kimi-K2.5 checkpoints (written by transformers) are converted to the
released MXFP4 layout in both exclude styles (atom_like.zoo.quark_mxfp4). The reference is the
float checkpoint loaded by transformers, with transformers' own per-expert MLP class for the
routed experts (DeepseekV3MLP: the Linear modules Quark quantizes), every quantized weight
replaced by its dequantized value and every quantized GEMM input passed through amd-quark's
MXFP4 quantize-dequantize (fake_quantize_fp4_fp6_per_group_with_scale, even_round scales).
Then the same with an EAGLE3 draft (lossless), and with --mxfp4-activations unquantized (W4A16)
against the reference without input QDQ.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

from atom_like import LLMEngine, SamplingParams
from atom_like.models.deepseek_v2 import DeepseekV2MoE
from atom_like.zoo.quark_mxfp4 import convert
from model_ops.linear import MergedColumnParallelLinear
from model_ops.quant.mxfp4 import dequantize_mxfp4
from model_ops.quant.mxfp4_layers import MXFP4Experts, MXFP4Linear

quark_utils = pytest.importorskip("quark.torch.quantization.utils")
quark_emul = pytest.importorskip("quark.torch.kernel.hw_emulation.hw_emulation_interface")

PROMPTS = [[3, 17, 42, 9, 100, 5, 77], list(range(5, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
KIMI = dict(n_group=1, topk_group=1, routed_scaling_factor=2.827)


class PerExpertMoE(nn.ModuleList):
    """transformers' DeepseekV3Experts loop over per-expert DeepseekV3MLP modules."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            if len(token):
                out.index_add_(0, token, expert(hidden_states[token]) * top_k_weights[token, slot, None])
        return out


def quark_qdq(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    scale = quark_utils.even_round(rows.unflatten(-1, (-1, 32)).abs().amax(-1), "fp4")
    return quark_emul.fake_quantize_fp4_fp6_per_group_with_scale(rows, scale, -1, 32, "fp4").view(x.shape)


def reference(src: str, dst: str, arch: str, quantize_inputs: bool) -> nn.Module:
    """transformers' model of float checkpoint `src` carrying the MXFP4 checkpoint `dst`'s weights."""
    auto = AutoModelForImageTextToText if arch == "kimi" else AutoModelForCausalLM
    hf = auto.from_pretrained(src, dtype=torch.float32).eval()
    text = hf.config.get_text_config()
    for name, module in list(hf.named_modules()):
        if type(module).__name__ == "DeepseekV3Experts":
            experts = PerExpertMoE(DeepseekV3MLP(text, intermediate_size=text.moe_intermediate_size)
                                   for _ in range(module.num_experts))
            gate, up = module.gate_up_proj.data.chunk(2, dim=1)
            for e, mlp in enumerate(experts):
                mlp.gate_proj.weight.data, mlp.up_proj.weight.data = gate[e], up[e]
                mlp.down_proj.weight.data = module.down_proj.data[e]
            parent, _, leaf = name.rpartition(".")
            setattr(hf.get_submodule(parent), leaf, experts)
    packed = load_file(os.path.join(dst, "model.safetensors"))
    quantized = 0
    for key in (k for k in packed if k.endswith(".weight_scale")):
        module_name = key.removesuffix(".weight_scale")
        # the checkpoint's Kimi layout -> transformers' in-memory names
        module_name = re.sub(r"^language_model\.model\.", "model.language_model.", module_name)
        linear = hf.get_submodule(module_name)
        linear.weight.data = dequantize_mxfp4(packed[key.replace("weight_scale", "weight")], packed[key])
        if quantize_inputs:
            linear.register_forward_pre_hook(lambda _, args: (quark_qdq(args[0]),))
        quantized += 1
    assert quantized, "the converted checkpoint quantizes nothing"
    return hf


def hf_greedy(hf: nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def engine_greedy(engine: LLMEngine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def converted(make_deepseek, tmp_path_factory):
    """(arch, style) -> (float source, MXFP4 folder), converted once per test module."""
    cache: dict[tuple[str, str], tuple[str, str]] = {}

    def make(arch: str, style: str) -> tuple[str, str]:
        if (arch, style) not in cache:
            src = make_deepseek(arch, **(KIMI if arch == "kimi" else {}))
            # exact names (Quark's exporter) for one style, glob patterns for the other
            dst = convert(src, tmp_path_factory.mktemp(f"mxfp4_{arch}_{style}"), style=style,
                          exclude_as="names" if style == "released" else "patterns")
            cache[(arch, style)] = (src, str(dst))
        return cache[(arch, style)]

    return make


@pytest.mark.parametrize("arch,style", [("v3", "released"), ("v3", "experts_only"), ("kimi", "released"),
                                        ("kimi", "experts_only")])
def test_greedy_matches_transformers_with_quark_qdq(converted, arch, style):
    src, dst = converted(arch, style)
    engine = LLMEngine(dst, max_model_len=128)
    layers = dict(engine.runner.model.named_modules())
    experts = [m for m in layers.values() if isinstance(m, MXFP4Experts)]
    linears = [n for n, m in layers.items() if isinstance(m, MXFP4Linear)]
    assert len(experts) == 2 and all(m.quantize_activations for m in experts)
    # released: the dense layer-0 MLP and the shared experts are MXFP4 too, the shared expert fused
    # into the routed experts as expert E; experts_only: it stays a separate float MLP; MLA never is
    assert len(linears) == (2 if style == "released" else 0), linears
    assert all("self_attn" not in n for n in linears)
    moes = [m for m in layers.values() if isinstance(m, DeepseekV2MoE)]
    num_routed = moes[0].gate.gating.num_experts
    fused = style == "released"
    assert [(m.shared_slot, m.experts.num_experts, m.shared_experts is None) for m in moes] == \
        [(num_routed if fused else None, num_routed + fused, fused)] * 2
    if not fused:
        assert all(isinstance(m.shared_experts.gate_up_proj, MergedColumnParallelLinear) for m in moes)
    assert experts[0].w13.dtype == torch.uint8  # packed in memory: 4.25 bits a weight
    hf = reference(src, dst, arch, quantize_inputs=True)
    for prompt, out in zip(PROMPTS, engine_greedy(engine)):
        assert out == hf_greedy(hf, prompt, GREEDY.max_tokens), f"{arch}/{style}: prompt of {len(prompt)} tokens"


def test_w4a16_flag_matches_transformers_without_input_qdq(converted):
    src, dst = converted("v3", "released")
    engine = LLMEngine(dst, max_model_len=128, mxfp4_activations="unquantized")
    assert not any(getattr(m, "quantize_activations", False) for m in engine.runner.model.modules())
    hf = reference(src, dst, "v3", quantize_inputs=False)
    outs = engine_greedy(engine)
    for prompt, out in zip(PROMPTS, outs):
        assert out == hf_greedy(hf, prompt, GREEDY.max_tokens)
    # and the activation quantization matters: W4A4 greedy differs somewhere
    assert outs != engine_greedy(LLMEngine(dst, max_model_len=128))


@pytest.mark.parametrize("arch,style,draft", [("kimi", "released", "mha"), ("v3", "experts_only", "mla")])
def test_eagle3_on_mxfp4_is_lossless(converted, make_eagle3_llama, make_eagle3_mla, arch, style, draft):
    src, dst = converted(arch, style)
    make = make_eagle3_llama if draft == "mha" else make_eagle3_mla
    path = make(src, aux_layer_ids=(0, 1, 2))
    plain = engine_greedy(LLMEngine(dst, max_model_len=128))
    spec = LLMEngine(dst, max_model_len=128, method="eagle3", draft_model=path, num_speculative_tokens=3)
    assert engine_greedy(spec) == plain
    assert spec.scheduler.spec_stats.num_drafts > 0


@pytest.mark.parametrize("arch", ["v3", "kimi"])
def test_fused_shared_expert_is_the_separate_one(converted, arch):
    """--fuse-shared-experts (default) against --no-fuse-shared-experts on one released
    checkpoint: each MoE layer's output equal within fp32 rounding (rtol 1e-6, atol 1e-6; the
    reference sums the slots in another order), greedy tokens identical, and the fused layer
    really runs the shared expert (its slot changed, the output moves)."""
    _, dst = converted(arch, "released")
    fused, separate = LLMEngine(dst, max_model_len=128), LLMEngine(dst, max_model_len=128, fuse_shared_experts=False)
    others = dict(separate.runner.model.named_modules())
    pairs = [(a, others[n]) for n, a in fused.runner.model.named_modules() if isinstance(a, DeepseekV2MoE)]
    assert len(pairs) == 2 and all(b.shared_slot is None and b.shared_experts is not None for _, b in pairs)
    x = torch.randn(7, pairs[0][0].gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for a, b in pairs:
            slot = a.shared_slot
            assert torch.equal(a.experts.w13[slot], b.shared_experts.gate_up_proj.weight)
            assert torch.equal(a.experts.w2_scale[slot], b.shared_experts.down_proj.weight_scale)
            out = a(x)
            torch.testing.assert_close(out, b(x), rtol=1e-6, atol=1e-6)
            a.experts.w2.data[slot] ^= 0x11  # another shared down_proj: the fused output must follow it
            assert not torch.allclose(a(x), out, rtol=1e-3, atol=1e-3)
            a.experts.w2.data[slot] ^= 0x11
    assert engine_greedy(fused) == engine_greedy(separate)
