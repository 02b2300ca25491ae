"""Our Quark MXFP4 writer (atom_like.zoo.quark_mxfp4) against amd-quark 0.13 itself.

amd-quark quantizes nn.Linear modules only, so the tiny DeepSeek-V3 here gets transformers' own
per-expert DeepseekV3MLP modules for its routed experts (what Quark's quantizer then sees, and
what the released checkpoints name `experts.{e}.{gate,up,down}_proj`). Quark quantizes and
exports it; our writer converts the same float weights. Every tensor must be bit-identical and
the quantization_config equal (the exclude list as a set), for both exclude styles, with the fp8
KV-cache scales of `kv_cache_scheme="fp8"` (their values, calibrated by Quark, are handed over).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

from atom_like.zoo.quark_mxfp4 import EXCLUDES, write

quark = pytest.importorskip("quark.torch")

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128,
            tie_word_embeddings=False)


class PerExpertMoE(nn.ModuleList):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            out.index_add_(0, token, expert(hidden_states[token]) * top_k_weights[token, slot, None])
        return out


def per_expert_model() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    config = DeepseekV3Config(**TINY)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    for layer in model.model.layers[config.first_k_dense_replace:]:
        old = layer.mlp.experts
        experts = PerExpertMoE(DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size)
                               for _ in range(config.n_routed_experts))
        gate, up = old.gate_up_proj.data.chunk(2, dim=1)
        for e, mlp in enumerate(experts):
            mlp.gate_proj.weight.data, mlp.up_proj.weight.data = gate[e].clone(), up[e].clone()
            mlp.down_proj.weight.data = old.down_proj.data[e].clone()
        layer.mlp.experts = experts
    return model


@pytest.mark.parametrize("style,kv_cache", [("released", True), ("experts_only", False)])
def test_writer_matches_amd_quark_export(tmp_path, style, kv_cache):
    model = per_expert_model()
    floats = {k: v.clone() for k, v in model.state_dict().items()}
    # the kimi_k25 template's exclude is the experts_only style; AMD's card passes --exclude_layers
    config = quark.LLMTemplate.get("kimi_k25").get_config(scheme="mxfp4", kv_cache_scheme="fp8" if kv_cache else None,
                                                          exclude_layers=EXCLUDES[style])
    quantizer = quark.ModelQuantizer(config)
    model = quantizer.freeze(quantizer.quantize_model(model, [torch.randint(0, 64, (1, 12)) for _ in range(2)]))
    quark.export_safetensors(model, tmp_path / "quark")
    theirs = load_file(str(tmp_path / "quark" / "model.safetensors"))
    their_config = json.loads((tmp_path / "quark" / "config.json").read_text())["quantization_config"]

    kv_scales = {k.removesuffix(".kv_a_proj_with_mqa.output_scale"): v.item()
                 for k, v in theirs.items() if k.endswith("kv_a_proj_with_mqa.output_scale")}
    assert bool(kv_scales) == kv_cache
    write(floats, {}, tmp_path / "ours", style=style, exclude_as="names", kv_scales=kv_scales or None)
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    our_config = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]

    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    packed = [n for n in theirs if n.endswith("weight_scale")]
    assert any(".experts.3.down_proj" in n for n in packed)
    assert any("layers.0.mlp.gate_proj" in n for n in packed) == (style == "released")
    assert set(our_config.pop("exclude")) == set(their_config.pop("exclude"))
    assert our_config == their_config
