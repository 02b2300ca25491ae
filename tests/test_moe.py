"""MoE gating and experts against transformers' DeepSeek routers and experts, and config errors
that name the field."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_DEEPSEEK
from transformers import DeepseekV2Config, DeepseekV3Config, PretrainedConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3TopkRouter

from atom_like.models.deepseek_v2 import DeepseekV3ForCausalLM
from model_ops.moe import FusedExperts, GatingConfig, TopkRouter, expert_weight_rule, fused_experts

TOKENS = 64
MOE = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5)


def routing(router, x):
    """(weights, ids) sorted by expert id, so two routers' orders need not agree."""
    weights, ids = router(x)[-2:]
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (4, 1, False), (1, 1, True), (8, 3, True)])
def test_sigmoid_noaux_tc_matches_deepseek_v3_router(n_group, topk_group, norm):
    config = DeepseekV3Config(**MOE, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    gen = torch.Generator().manual_seed(n_group * 10 + topk_group)
    hf = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)  # changes which experts win
    ours = TopkRouter(32, GatingConfig.from_config(config, "sigmoid", "noaux_tc"))
    ours.weight.copy_(hf.weight)
    ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(TOKENS, 32, generator=gen)
    (w_ref, ids_ref), (w, ids) = routing(hf, x), routing(ours, x)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_correction_bias_moves_selection_but_not_weights():
    config = DeepseekV3Config(**MOE, n_group=1, topk_group=1, norm_topk_prob=False)
    gating = GatingConfig.from_config(config, "sigmoid", "noaux_tc")
    gen = torch.Generator().manual_seed(3)
    router = TopkRouter(32, gating)
    router.weight.copy_(torch.randn(16, 32, generator=gen))
    router.e_score_correction_bias.zero_()
    x = torch.randn(TOKENS, 32, generator=gen)
    _, ids_plain = routing(router, x)
    router.e_score_correction_bias.copy_(torch.linspace(-1, 1, 16))  # favours high expert ids
    weights, ids = routing(router, x)
    assert not torch.equal(ids, ids_plain)
    expected = torch.sigmoid(x @ router.weight.T).gather(1, ids) * 2.5  # unbiased scores
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_softmax_matches_deepseek_v2_router(method):
    config = DeepseekV2Config(**MOE, n_group=4, topk_group=2, topk_method=method)
    gen = torch.Generator().manual_seed(7)
    hf = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
    ours = TopkRouter(32, GatingConfig.from_config(config, "softmax", "greedy"))
    ours.weight.copy_(hf.weight)
    x = torch.randn(TOKENS, 32, generator=gen)
    (w_ref, ids_ref), (w, ids) = routing(hf, x), routing(ours, x)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_reference_experts_match_transformers_experts():
    config = DeepseekV3Config(**MOE, moe_intermediate_size=24)
    gen = torch.Generator().manual_seed(11)
    hf = DeepseekV3Experts(config)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(hf.gate_up_proj.shape, generator=gen) * 0.2)
        hf.down_proj.copy_(torch.randn(hf.down_proj.shape, generator=gen) * 0.2)
    x = torch.randn(TOKENS, 32, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, 4, generator=gen)
    torch.testing.assert_close(fused_experts(x, hf.gate_up_proj, hf.down_proj, weights, ids), hf(x, ids, weights))


def test_expert_names_map_to_stacked_shards():
    experts = FusedExperts(4, 8, 6)
    prefix = "model.layers.3.mlp.experts"
    assert expert_weight_rule(f"{prefix}.2.up_proj.weight") == (f"{prefix}.w13", "2.up_proj")
    assert expert_weight_rule(f"{prefix}.0.down_proj.weight") == (f"{prefix}.w2", "0.down_proj")
    assert expert_weight_rule(f"{prefix}.gate_up_proj") == (f"{prefix}.w13", None)
    assert expert_weight_rule("model.layers.3.mlp.shared_experts.up_proj.weight") is None
    assert experts.shard_view("w13", "2.up_proj").data_ptr() == experts.w13[2, 6:].data_ptr()
    assert experts.shard_view("w13", "2.gate_proj").shape == (6, 8)
    assert len(experts.weight_shards("w13")) == 8 and len(experts.weight_shards("w2")) == 4


def model_config(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**{**TINY_DEEPSEEK, **overrides})


@pytest.mark.parametrize("overrides,match", [
    (dict(scoring_func="sqrtsoftplus"), "scoring_func 'sqrtsoftplus'"),
    (dict(topk_method="random"), "topk_method 'random'"),
    (dict(n_group=2, topk_group=3), "topk_group 3 > n_group 2"),
    (dict(n_group=3), "n_routed_experts 8 is not a multiple of n_group 3"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 exceeds"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_bad_routing_configs_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        DeepseekV3ForCausalLM(model_config(**overrides))


def test_mla_without_kv_lora_rank_is_named():
    """transformers' own config classes refuse kv_lora_rank=None; remote-code configs may omit it."""
    fields = {k: v for k, v in model_config().to_dict().items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match="no kv_lora_rank"):
        DeepseekV3ForCausalLM(PretrainedConfig(**fields))
