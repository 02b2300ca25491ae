"""kernels_rocm.moe_routing (one-launch MoE routing) against model_ops.moe.select_experts, the
reference, in the interpreter: every scoring / grouping mode of the released DeepSeek-V2/V3 and
Kimi configs, group sizes that are not powers of two, one and several tokens; the router
module end to end with the GEMV kernel's fp32 logits."""
from __future__ import annotations

import pytest
import torch

from kernels_rocm.moe_routing import route_topk
from model_ops.moe import GatingConfig, TopkRouter, _routing_kernel, select_experts

# (experts, top_k, scoring, topk_method, n_group, topk_group, norm, scaling)
GATINGS = {
    "kimi_k25": (384, 8, "sigmoid", "noaux_tc", 1, 1, True, 2.827),
    "deepseek_v3": (64, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5),
    "v3_odd_groups": (72, 5, "sigmoid", "noaux_tc", 4, 2, False, 1.0),  # 18 experts a group
    "v2_greedy": (64, 6, "softmax", "greedy", 1, 1, False, 16.0),
    "v2_group_limited": (60, 6, "softmax", "group_limited_greedy", 6, 3, True, 1.0),
}


def _gating(name: str) -> GatingConfig:
    e, k, scoring, method, groups, keep, norm, scaling = GATINGS[name]
    gating = GatingConfig(e, k, scoring, method, groups, keep, norm, scaling)
    gating.validate()
    return gating


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("name", list(GATINGS))
def test_matches_select_experts(name, tokens):
    gating = _gating(name)
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, gating.num_experts, generator=g) * 2
    bias = torch.randn(gating.num_experts, generator=g) * 0.5 if gating.topk_method == "noaux_tc" else None
    weights, ids = _routing_kernel(logits, bias, gating)
    assert weights.shape == ids.shape == (tokens, gating.top_k) and ids.dtype == torch.int64
    ref_weights, ref_ids = select_experts(logits, bias, gating)
    weights, ids = _by_expert(weights, ids)
    ref_weights, ref_ids = _by_expert(ref_weights, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_groups_decide():
    """The group rule changes the result here (the best single expert sits in a weak group), so a
    kernel that ignored groups, or ranked them by their best score under noaux_tc, would fail."""
    gating = GatingConfig(16, 2, "sigmoid", "noaux_tc", 4, 2, False, 1.0)
    logits = torch.full((1, 16), -4.0)
    logits[0, 0] = 6.0  # group 0: one strong expert, top-2 sum ~1.02
    logits[0, 4:6] = 2.0  # group 1: two good ones, ~1.76
    logits[0, 8:10] = 1.5  # group 2: ~1.64
    weights, ids = _routing_kernel(logits, torch.zeros(16), gating)
    assert sorted(ids[0].tolist()) == [4, 5]
    assert torch.equal(_by_expert(weights, ids)[1], _by_expert(*select_experts(logits, torch.zeros(16), gating))[1])


def test_ties_pick_the_lowest_index():
    weights, ids = route_topk(torch.zeros(2, 12), None, 3, sigmoid=True, norm=True)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))


def test_empty_and_bad_inputs():
    weights, ids = route_topk(torch.zeros(0, 8), None, 2, sigmoid=True)
    assert weights.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="logits must have dtype"):
        route_topk(torch.zeros(1, 8, dtype=torch.bfloat16), None, 2, sigmoid=True)
    with pytest.raises(ValueError, match="bias .*logits' expert count"):
        route_topk(torch.zeros(1, 8), torch.zeros(7), 2, sigmoid=True)
    with pytest.raises(ValueError, match="8 experts in 3 groups"):
        route_topk(torch.zeros(1, 8), None, 2, sigmoid=True, n_group=3, topk_group=1)


def test_router_module_with_the_kernels():
    """TopkRouter as the GPU runs it (the routing kernel; its logits from dense_fp32, F.linear on
    the CPU) against the reference path, bf16 weights as released."""
    gating = _gating("deepseek_v3")
    router = TopkRouter(96, gating)
    g = torch.Generator().manual_seed(3)
    router.weight.data = (torch.randn(gating.num_experts, 96, generator=g) * 0.1).bfloat16()
    router.e_score_correction_bias.data = torch.randn(gating.num_experts, generator=g) * 0.1
    x = torch.randn(3, 96, generator=g).bfloat16()
    assert router.route is select_experts  # the CPU's
    ref = _by_expert(*router(x))
    router.route = _routing_kernel
    out = _by_expert(*router(x))
    assert torch.equal(out[1], ref[1])
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["kimi_k25", "deepseek_v3"])
def test_fused_shared_expert_slot(name):
    """With a fused shared expert the kernel writes its slot itself: last, id E, weight exactly 1.0
    (unscaled), the routed slots as without it; the reference appends the same slot."""
    gating = _gating(name)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, gating.num_experts, generator=g)
    bias = torch.randn(gating.num_experts, generator=g) * 0.5
    weights, ids = _routing_kernel(logits, bias, gating, gating.num_experts)
    assert weights.shape == ids.shape == (3, gating.top_k + 1)
    assert (ids[:, -1] == gating.num_experts).all() and (weights[:, -1] == 1.0).all()
    routed = _routing_kernel(logits, bias, gating)
    assert torch.equal(weights[:, :-1], routed[0]) and torch.equal(ids[:, :-1], routed[1])
    ref_weights, ref_ids = select_experts(logits, bias, gating, gating.num_experts)
    assert torch.equal(ref_ids[:, -1], ids[:, -1]) and torch.equal(ref_weights[:, -1], weights[:, -1])
