"""MoE routing in one launch: fp32 router logits [T, E] -> (weights [T, K] fp32, expert ids [T, K]).

The same computation as model_ops.moe.select_experts (the reference, itself transformers'
DeepseekV2/V3 routers): scores = sigmoid or softmax of the logits; the selection score adds the
optional correction bias; with group-limited routing the groups are ranked by the sum of their
top-2 selection scores (noaux_tc) or their best score, and all but the best `topk_group` groups
are dropped; the top K selection scores pick the experts; their weights are the unbiased scores,
renormalised (`norm`, + 1e-20 as the reference) and multiplied by `scaling`.

Why a kernel: in torch this is ~10 launches a MoE layer (sigmoid, add, topk, gather, sum,
divide, multiply, and the groups' topk / scatter / masked_fill), each a few microseconds at
decode; with the fp32 router GEMM and its fp32 weight copy it was ~30 us of a Kimi-K2.5 layer's
~130 us on an H200 at batch 1 (docs/benchmarks.md section 10). One program per token holds its
E scores in registers as a [groups, experts per group] tile and selects by repeated arg-max (K
and topk_group are small), lowest index first among equal scores (torch.topk leaves ties
unspecified). Decisions from shapes only: graph-capturable. Never run on AMD hardware (it is
plain Triton, compiled for gfx942/gfx950 like the other kernels here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import check_dim, check_same_device, check_tensor

GROUP_SCORES = ("top2_sum", "max")


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t: tl.int64, per_group, scaling, shared_id,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, TOP2_SUM: tl.constexpr,
    NORM: tl.constexpr, HAS_SHARED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, BLOCK_G)[:, None]
    within = tl.arange(0, BLOCK_EG)[None, :]
    expert = group * per_group + within  # [BLOCK_G, BLOCK_EG]
    valid = (group < N_GROUP) & (within < per_group)
    logit = tl.load(logits_ptr + t * stride_t + expert, mask=valid, other=float("-inf"))
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logit))
    else:
        p = tl.exp(logit - tl.max(tl.max(logit, axis=1), axis=0))
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        best = tl.max(choice, axis=1)  # [BLOCK_G]
        if TOP2_SUM:  # drop one arg-max of each group, take the best again
            first = tl.min(tl.where(choice == best[:, None], within, BLOCK_EG), axis=1)
            best += tl.max(tl.where(within == first[:, None], float("-inf"), choice), axis=1)
        gid = tl.arange(0, BLOCK_G)
        group_score = tl.where(gid < N_GROUP, best, float("-inf"))
        keep = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.min(tl.where(group_score == tl.max(group_score, axis=0), gid, BLOCK_G), axis=0)
            keep = keep | (gid == pick)
            group_score = tl.where(gid == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    big = N_GROUP * per_group
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, big), axis=1), axis=0)
        chosen = expert == pick
        weights = tl.where(slot == k, tl.sum(tl.sum(tl.where(chosen, scores, 0.0), axis=1), axis=0), weights)
        ids = tl.where(slot == k, pick.to(tl.int64), ids)
        choice = tl.where(chosen, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    width: tl.constexpr = TOP_K + 1 if HAS_SHARED else TOP_K
    weights = weights * scaling
    if HAS_SHARED:  # the fused shared expert's slot, after the routed ones: weight exactly 1.0
        weights = tl.where(slot == TOP_K, 1.0, weights)
        ids = tl.where(slot == TOP_K, shared_id.to(tl.int64), ids)
    tl.store(weights_ptr + t * width + slot, weights, mask=slot < width)
    tl.store(ids_ptr + t * width + slot, ids, mask=slot < width)


def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool, n_group: int = 1,
               topk_group: int = 1, group_score: str = "top2_sum", norm: bool = True,
               scaling: float = 1.0, shared_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 (contiguous rows), bias [E] fp32 or None -> (weights [T, top_k] fp32,
    ids [T, top_k] int64). Groups are used when topk_group < n_group, ranked by `group_score`
    ("top2_sum": noaux_tc; "max": group_limited_greedy). `shared_id`: a shared expert fused into
    the routed ones as that expert id; every token gets it as an extra last slot with weight 1.0
    ([T, top_k + 1]). Arguments as validated by model_ops.moe.GatingConfig; only tensor shapes
    are checked here."""
    check_tensor("logits", logits, 2, (torch.float32,))
    num_tokens, num_experts = logits.shape
    if bias is not None:
        check_tensor("bias", bias, 1, (torch.float32,))
        check_dim("bias", bias, 0, num_experts, "logits' expert count")
        check_same_device(logits=logits, bias=bias)
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score {group_score!r}: one of {', '.join(GROUP_SCORES)}")
    if num_experts % n_group or not 1 <= top_k <= num_experts:
        raise ValueError(f"{num_experts} experts in {n_group} groups, top_k {top_k}: groups must divide the "
                         "experts and top_k be in [1, experts]")
    width = top_k + (shared_id is not None)
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=logits.device)
    if num_tokens:
        grouped = topk_group < n_group
        per_group = num_experts // n_group if grouped else num_experts
        groups = n_group if grouped else 1
        # one warp up to 1,024 experts (32 scores a lane): the 2K + 2 reductions of the selection are then
        # warp shuffles, no shared memory and no barriers
        block = triton.next_power_of_2(groups) * triton.next_power_of_2(per_group)
        _route_kernel[(num_tokens,)](
            logits, bias if bias is not None else logits, weights, ids, logits.stride(0), per_group, scaling,
            shared_id or 0,
            N_GROUP=groups, TOPK_GROUP=topk_group if grouped else 1, TOP_K=top_k,
            BLOCK_G=triton.next_power_of_2(groups), BLOCK_EG=triton.next_power_of_2(per_group),
            BLOCK_K=triton.next_power_of_2(width), SIGMOID=sigmoid, HAS_BIAS=bias is not None, GROUPED=grouped,
            TOP2_SUM=group_score == "top2_sum", NORM=norm, HAS_SHARED=shared_id is not None, num_warps=1 if block <= 1024 else 4,
            **pdl.launch_args(logits.device),
        )
    return weights, ids
