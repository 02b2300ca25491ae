"""Shared-expert fusion (model_ops.moe.SharedExpertHost, atom_like.loader.quark): decided by the
quantization config alone, per MoE block; the loader sends the shared expert's tensors to slot E
of the stacked experts; the routing slot weighs it exactly 1.0. Meta-device skeletons, no
weights: milliseconds. Exactness against the separate shared MLP and transformers is in
test_mxfp4_models.py, tensor parallelism in test_tensor_parallel.py (test_mxfp4_kimi_tp2)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_DEEPSEEK
from transformers import DeepseekV3Config

from atom_like.loader.quark import QuarkConfig, quantize_model
from atom_like.loader.weights import _map_name, rename
from atom_like.models.deepseek_v2 import DeepseekV2MoE, DeepseekV3ForCausalLM
from atom_like.models.kimi_k25 import KimiK25ForConditionalGeneration
from atom_like.zoo.quark_mxfp4 import EXCLUDES, quantization_config
from model_ops.deferred import deferred_weights
from model_ops.linear import MergedLinear
from model_ops.moe import append_shared_expert
from model_ops.quant.mxfp4_layers import MXFP4Experts, MXFP4MergedLinear

E = TINY_DEEPSEEK["n_routed_experts"]


def w4a16_shared(raw: dict) -> dict:
    """The shared experts MXFP4 without activation quantization, the routed ones W4A4."""
    layer = copy.deepcopy(raw["global_quant_config"])
    layer["input_tensors"] = None
    raw["layer_quant_config"] = {"*shared_experts*": layer}
    return raw


def build(raw: dict, model_cls=DeepseekV3ForCausalLM, **kwargs):
    config = DeepseekV3Config(**{**TINY_DEEPSEEK, **kwargs.pop("config", {})})
    with deferred_weights():
        model = model_cls(config)
        quantize_model(model, QuarkConfig(raw), model.weight_map(), **kwargs)
    return model


def moe_blocks(model) -> list[DeepseekV2MoE]:
    return [m for m in model.modules() if isinstance(m, DeepseekV2MoE)]


@pytest.mark.parametrize("case, fused", [
    ("released", True),  # AMD's Kimi-K2.5-MXFP4: shared experts MXFP4 exactly like the routed ones
    ("released W4A16", True),  # --mxfp4-activations unquantized: every layer W4A16 alike
    ("experts_only", False),  # shared experts excluded: bf16 beside MXFP4 routed experts
    ("shared down_proj excluded", False),
    ("shared experts W4A16, routed W4A4", False),
    ("--no-fuse-shared-experts", False),
    ("n_shared_experts 2", False),  # the shared MLP is twice a routed expert's width
])
def test_fusion_is_decided_by_the_config_alone(case, fused):
    raw = quantization_config(EXCLUDES["experts_only" if case == "experts_only" else "released"])
    kwargs = {}
    if case == "released W4A16":
        kwargs["activations"] = "unquantized"
    elif case == "shared down_proj excluded":
        raw["exclude"].append("*shared_experts.down_proj")
    elif case == "shared experts W4A16, routed W4A4":
        raw = w4a16_shared(raw)
    elif case == "--no-fuse-shared-experts":
        kwargs["fuse_shared_experts"] = False
    elif case == "n_shared_experts 2":
        kwargs["config"] = {"n_shared_experts": 2}
    model = build(raw, **kwargs)
    blocks = moe_blocks(model)
    assert len(blocks) == 2 and all(isinstance(b.experts, MXFP4Experts) for b in blocks)
    for b in blocks:
        assert (b.shared_slot, b.experts.num_experts, b.shared_experts is None) == \
            ((E, E + 1, True) if fused else (None, E, False)), case
        assert b.experts.w13.shape[0] == b.experts.w2_scale.shape[0] == E + fused
        assert not b.experts.w13.is_meta  # packed once, at its final size
    rules = model.weight_map().rules
    assert len(rules) == 1 + fused
    if not fused:
        gate_up = blocks[0].shared_experts.gate_up_proj
        assert isinstance(gate_up, MXFP4MergedLinear if case not in ("experts_only",) else MergedLinear)


@pytest.mark.parametrize("model_cls, prefix", [(DeepseekV3ForCausalLM, "model."),
                                               (KimiK25ForConditionalGeneration, "language_model.model.")])
def test_the_loader_sends_the_shared_expert_to_slot_e(model_cls, prefix):
    model = build(quantization_config(EXCLUDES["released"]), model_cls)
    wm = model.weight_map()
    for proj, param, shard in (("gate_proj", "w13", "gate_proj"), ("up_proj", "w13", "up_proj"),
                               ("down_proj", "w2", "down_proj")):
        for suffix, scale in (("weight", ""), ("weight_scale", "_scale")):
            name = rename(f"{prefix}layers.2.mlp.shared_experts.{proj}.{suffix}", wm)
            assert _map_name(name, wm) == (f"{prefix}layers.2.mlp.experts.{param}{scale}", f"{E}.{shard}")
    # routed experts and the dense layer-0 MLP map as before
    assert _map_name(f"{prefix}layers.1.mlp.experts.3.up_proj.weight", wm) == (f"{prefix}layers.1.mlp.experts.w13",
                                                                              "3.up_proj")
    assert _map_name(f"{prefix}layers.0.mlp.up_proj.weight", wm) == (f"{prefix}layers.0.mlp.gate_up_proj.weight", 1)
    # a block left unfused keeps its shared expert's own parameters
    separate = build(quantization_config(EXCLUDES["released"]), model_cls, fuse_shared_experts=False).weight_map()
    assert _map_name(f"{prefix}layers.2.mlp.shared_experts.up_proj.weight", separate) == \
        (f"{prefix}layers.2.mlp.shared_experts.gate_up_proj.weight", 1)


def test_the_shared_slot_weighs_exactly_one_on_every_token():
    weights = torch.rand(5, 2) * 2.5  # routed weights, already scaled by routed_scaling_factor
    ids = torch.randint(0, E, (5, 2))
    w, i = append_shared_expert(weights, ids, E)
    assert w.dtype == weights.dtype and i.dtype == ids.dtype and w.shape == i.shape == (5, 3)
    assert torch.equal(w[:, :2], weights) and torch.equal(i[:, :2], ids)
    assert torch.equal(w[:, 2], torch.ones(5)) and torch.equal(i[:, 2], torch.full((5,), E))
