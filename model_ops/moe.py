"""DeepSeek-style mixture of experts: the router (gating) and the routed experts.

Gating follows transformers' routers, the oracle: DeepseekV3TopkRouter (sigmoid scores, the
`e_score_correction_bias` added for selection only, groups ranked by the sum of their top-2
biased scores, "noaux_tc") and DeepseekV2TopkRouter (softmax scores, "greedy" or groups ranked by
their best score, "group_limited_greedy"). Every step is a device op (no host syncs), so routing
can be captured in a graph. Weights always come from the unbiased scores, are renormalised when
`norm_topk_prob`, then multiplied by `routed_scaling_factor` (transformers' V2 router ignores
`norm_topk_prob`; no released V2 checkpoint sets it).

Routed experts are stored stacked, w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I],
and run through one function with the signature of kernels_rocm's Triton fused MoE;
`select_experts_impl` is the one switch between it and the reference loop here. A Quark MXFP4
checkpoint swaps FusedExperts for model_ops.quant.mxfp4_layers.MXFP4Experts (same call, packed
weights) before any float weight is allocated (model_ops.deferred).
"""
from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from model_ops import tp
from model_ops.activation import silu_and_mul
from model_ops.deferred import weight_device
from model_ops.linear import dense_fp32
from model_ops.tp import TPSlice

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")

# (x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K] fp32, topk_ids [T, K]) -> [T, H]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GatingConfig:
    num_experts: int
    top_k: int
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_config(cls, config: PretrainedConfig, scoring_func: str, topk_method: str) -> "GatingConfig":
        """Read and check the routing fields; `scoring_func` / `topk_method` are the defaults of
        the architecture (transformers' configs omit them: V3 is sigmoid + noaux_tc)."""
        gating = cls(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok or 0,
            scoring_func=getattr(config, "scoring_func", None) or scoring_func,
            topk_method=getattr(config, "topk_method", None) or topk_method,
            n_group=getattr(config, "n_group", None) or 1,
            topk_group=getattr(config, "topk_group", None) or 1,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
        )
        gating.validate()
        return gating

    def validate(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; "
                             f"supported: {', '.join(SCORING_FUNCS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, n_routed_experts={self.num_experts}]")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} > n_group {self.n_group}: "
                             "cannot keep more expert groups than exist")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.num_experts} is not a multiple of n_group {self.n_group}")
        if self.grouped:
            per_group = self.num_experts // self.n_group
            if self.topk_method == "noaux_tc" and per_group < 2:
                raise ValueError(f"n_group {self.n_group} leaves {per_group} expert per group; "
                                 "noaux_tc ranks groups by their top 2")
            if self.top_k > self.topk_group * per_group:
                raise ValueError(f"num_experts_per_tok {self.top_k} exceeds the {self.topk_group * per_group} experts "
                                 f"in topk_group={self.topk_group} groups of n_group={self.n_group}")

    @property
    def grouped(self) -> bool:
        """Group-limited selection that can change the result (keeping every group is a no-op)."""
        return self.topk_method != "greedy" and self.topk_group < self.n_group


def select_experts(logits: torch.Tensor, bias: torch.Tensor | None, gating: GatingConfig,
                   shared_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, E] -> (weights [T, K] fp32, expert ids [T, K] int64); with a fused
    shared expert at `shared_slot`, [T, K + 1] (append_shared_expert)."""
    scores = logits.sigmoid() if gating.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if gating.grouped:
        grouped = choice.view(choice.shape[0], gating.n_group, -1)
        if gating.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(gating.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).flatten(1)
    ids = choice.topk(gating.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if gating.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * gating.routed_scaling_factor
    return (weights, ids) if shared_slot is None else append_shared_expert(weights, ids, shared_slot)


# (fp32 logits [T, E], correction bias [E] or None, gating, fused shared expert's slot or None)
#   -> (weights [T, K (+ 1)] fp32, ids [T, K (+ 1)] int64)
RoutingFn = Callable[[torch.Tensor, torch.Tensor | None, GatingConfig, int | None],
                     tuple[torch.Tensor, torch.Tensor]]


def _routing_kernel(logits: torch.Tensor, bias: torch.Tensor | None, gating: GatingConfig,
                    shared_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels_rocm.moe_routing import route_topk

    return route_topk(logits, bias, gating.top_k, gating.scoring_func == "sigmoid", gating.n_group,
                      gating.topk_group, "top2_sum" if gating.topk_method == "noaux_tc" else "max",
                      gating.norm_topk_prob, gating.routed_scaling_factor, shared_slot)


def select_routing_impl(device: torch.device) -> RoutingFn:
    """The one switch for routing: kernels_rocm.moe_routing (one launch instead of ~10) on a GPU
    where that module exists, else select_experts (the reference, and the CPU path)."""
    if device.type != "cpu" and importlib.util.find_spec("kernels_rocm.moe_routing") is not None:
        return _routing_kernel
    return select_experts


class TopkRouter(nn.Module):
    """`mlp.gate`: router weight [E, H] (+ the fp32 correction bias for noaux_tc)."""

    def __init__(self, hidden_size: int, gating: GatingConfig):
        super().__init__()
        self.gating = gating
        self.weight = nn.Parameter(torch.empty(gating.num_experts, hidden_size), requires_grad=False)
        # fp32 whatever the model dtype, like transformers (_keep_in_fp32_modules_strict)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(gating.num_experts, dtype=torch.float32), requires_grad=False)
            if gating.topk_method == "noaux_tc" else None
        )
        self.route = select_routing_impl(torch.get_default_device())

    def forward(self, x: torch.Tensor, shared_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) of x's tokens; with `shared_slot` (a shared expert fused into the routed
        ones) every token also gets that expert, weight 1.0, as its last slot."""
        logits = dense_fp32(x, self.weight)  # fp32 logits, as every reference does
        return self.route(logits, self.e_score_correction_bias, self.gating, shared_slot)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Reference routed experts: one SwiGLU per expert that received tokens, weighted sum over a
    token's K experts accumulated in fp32. Reads the routing on the host: not graph-capturable."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        y = F.linear(silu_and_mul(F.linear(x[token], w13[expert])), w2[expert])
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def select_experts_impl(device: torch.device) -> ExpertsFn:
    """The one switch for routed experts: the Triton fused MoE (kernels_rocm.fused_moe, same
    signature) on a GPU where that module exists, else the reference."""
    if device.type != "cpu" and importlib.util.find_spec("kernels_rocm.fused_moe") is not None:
        from kernels_rocm.fused_moe import fused_moe

        return fused_moe
    return fused_experts


@dataclass(frozen=True)
class ExpertsSharding:
    """Every rank holds every routed expert's rows `rows` of the `full` intermediate dim (gate
    and up rows of w13, columns of w2), so routing needs no communication and a rank's expert
    output is a partial sum the MoE block all-reduces. Shared by the float and the packed MXFP4
    experts, whose w13_* / w2_* companions (block scales) are cut like w13 / w2."""
    full: int
    rows: tuple[int, int]

    @classmethod
    def split(cls, intermediate_size: int) -> "ExpertsSharding":
        return cls(intermediate_size, tp.rank_range(intermediate_size, "moe_intermediate_size"))

    @property
    def size(self) -> int:
        return self.rows[1] - self.rows[0]

    def tp_slice(self, param: str, shard: Hashable | None, pack: int = 1, block: int = 1) -> TPSlice:
        """Per-expert checkpoint tensors are [I, H] (gate, up) and [H, I] (down); stacked ones
        [E, 2I, H] / [E, H, I] (shard None). `pack` / `block` are the storage format's along the
        intermediate dim (w2's input; w13 splits along its outputs and passes 1)."""
        full, (a, b), down = self.full, self.rows, param.startswith("w2")
        if shard is None:
            dim, ranges, extent = (2, ((a, b),), full) if down else (1, ((a, b), (full + a, full + b)), 2 * full)
        else:
            dim, ranges, extent = (1 if down else 0), ((a, b),), full
        return TPSlice(dim, extent, ranges, pack, block)


class FusedExperts(nn.Module):
    """`mlp.experts`: w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], I being this
    rank's part of the intermediate dim (ExpertsSharding). Under tensor parallelism `forward`
    returns this rank's partial sum: the MoE block all-reduces it (with the shared experts'
    partial sum, in one collective)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.sharding = ExpertsSharding.split(intermediate_size)
        self.num_experts, self.intermediate_size = num_experts, self.sharding.size
        # on the meta device while a quantization config may still replace this layer (model_ops.deferred)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size,
                                            device=weight_device()), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size, device=weight_device()),
                               requires_grad=False)
        self.impl = select_experts_impl(torch.get_default_device())

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.w13, self.w2, topk_weights, topk_ids)

    # TPSharded (model_ops.tp)
    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice:
        return self.sharding.tp_slice(param, shard)

    # ShardedParameters (atom_like.loader.weights): one shard per expert and projection, "3.up_proj".
    def weight_shards(self, param: str) -> list[str]:
        projections = ("down_proj",) if param == "w2" else ("gate_proj", "up_proj")
        return [f"{e}.{p}" for e in range(self.num_experts) for p in projections]

    def shard_view(self, param: str, shard: Hashable) -> torch.Tensor:
        expert, projection = str(shard).split(".")
        if projection == "down_proj":
            return self.w2.data[int(expert)]
        rows = slice(0, self.intermediate_size) if projection == "gate_proj" else slice(self.intermediate_size, None)
        return self.w13.data[int(expert), rows]


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def expert_weight_rule(name: str) -> tuple[str, str | None] | None:
    """Checkpoint expert names -> (FusedExperts / MXFP4Experts parameter, shard). Two layouts: per
    expert (`experts.{e}.{gate,up,down}_proj.weight`: DeepSeek/Kimi releases, and what transformers
    5.23's save_pretrained writes; Quark MXFP4 adds `.weight_scale` -> w13_scale / w2_scale) and
    stacked 3-D (`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]: transformers'
    in-memory layout, loaded whole)."""
    if m := _PER_EXPERT.match(name):
        suffix = "_scale" if m[4] == "weight_scale" else ""
        return f"{m[1]}.{'w2' if m[3] == 'down_proj' else 'w13'}{suffix}", f"{m[2]}.{m[3]}"
    if m := _STACKED.match(name):
        return f"{m[1]}.{'w13' if m[2] == 'gate_up_proj' else 'w2'}", None
    return None


# ----------------------------------------------------------------------------- shared expert fusion
# SGLang's shared-experts fusion: a shared expert with exactly the routed experts' format is
# stored as one more routed expert (slot E of w13 / w2 and their scales) and every token gets one
# more routing slot for it, so one fused-MoE launch pair runs both (the separate shared MLP is
# two GEMM launches, an activation and an add per layer, each latency-bound at decode).


@runtime_checkable
class SharedExpertHost(Protocol):
    """A MoE block whose shared expert may run as routed expert E. The quantization loader decides
    (atom_like.loader.quark), from the config alone: it fuses when the routed experts and every
    layer of the shared expert have one format."""

    def fusable_shared_expert(self) -> tuple[nn.Module, list[nn.Module]] | None:
        """(the routed experts, the shared expert's layers) while the shared expert has a routed
        expert's shape (one expert of the same intermediate size, no bias), so that only the
        formats remain to compare; None otherwise (or once fused)."""

    def fuse_shared_expert(self) -> None:
        """Replace the routed experts by E + 1 of the same kind (on the meta device while weights
        are deferred) and drop the separate shared expert; from then on forward routes every
        token to slot E too (the router appends it) and the loader fills slot E from the
        checkpoint's shared-expert tensors."""


def append_shared_expert(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused shared expert's routing slot: [T, K] -> [T, K + 1], every token also to expert
    `slot` with weight exactly 1.0 (the shared expert is neither renormalised nor scaled by
    routed_scaling_factor). The reference's; kernels_rocm.moe_routing writes the slot itself."""
    tokens = topk_ids.shape[0]
    return (torch.cat([topk_weights, topk_weights.new_ones(tokens, 1)], dim=1),
            torch.cat([topk_ids, topk_ids.new_full((tokens, 1), slot)], dim=1))
