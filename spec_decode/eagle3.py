"""What every EAGLE3 draft shares: its config fields (parsed here once for the MHA and MLA
families) and everything around its one decoder layer (fc, EAGLE3.1 fc_norm, final norm,
lm_head over the draft vocabulary, d2t).

One draft step (docs/eagle3_semantics.md, "One draft step"):
    g = fc(concat(fc_norm_i(aux_i)))                 first pass only: target aux hidden states
    out = layer(embed(token), g)                     residual = g, input = [norm(embed), norm(g)]
    logits = lm_head(norm(out))
    carry = norm(out) if norm_output else out        hidden for the next chain step

Tensor parallel (model_ops.tp): the decoder layer is split like the target's (heads, so its KV
is sharded across ranks as the target's is; MLP intermediate dim), embed_tokens and lm_head are
vocab-parallel (as the target's, whose weights a draft may borrow), and `fc` is replicated: it
runs once per proposal on the aux hidden states every rank already holds whole, so a replica
costs num_aux * H_target * H parameters per rank (3 * 7168^2 = 154M for Kimi, 0.3 GB in bf16)
and saves the all-reduce a row-parallel fc would add to every proposal. d2t is replicated.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from model_ops.attention.layer import CachedAttention
from model_ops.attention.metadata import AttentionMetadata
from model_ops.embed_head import LMHead, VocabEmbedding
from model_ops.layernorm import RMSNorm
from model_ops.linear import Linear
from model_ops.sampling import greedy_tokens

DEFAULT_NUM_AUX = 3


def _field(container: object, name: str):
    """A field of `eagle_config`, which checkpoints store as a dict or as a config object."""
    if isinstance(container, dict):
        return container.get(name)
    return getattr(container, name, None)


@dataclass(frozen=True)
class Eagle3Config:
    aux_layer_ids: tuple[int, ...] | None  # None: the target's defaults (2, N//2, N-3)
    num_aux: int
    target_hidden_size: int
    draft_vocab_size: int
    fc_norm: bool  # EAGLE3.1: RMSNorm each aux chunk before fc (legacy name: use_aux_norm)
    norm_output: bool  # EAGLE3.1: carry the post-norm hidden to the next step

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> "Eagle3Config":
        eagle = getattr(config, "eagle_config", None) or {}
        if _field(eagle, "use_aux_hidden_state") is False:
            raise ValueError("draft config: eagle_config.use_aux_hidden_state is false; atom_like runs EAGLE3 drafts, "
                             "which read the target's aux hidden states")
        ids = _field(eagle, "eagle_aux_hidden_state_layer_ids") or getattr(config, "eagle_aux_hidden_state_layer_ids", None)
        num_aux = len(ids) if ids else getattr(config, "num_aux_hidden_states", None) or DEFAULT_NUM_AUX
        return cls(
            aux_layer_ids=tuple(ids) if ids else None,
            num_aux=num_aux,
            target_hidden_size=getattr(config, "target_hidden_size", None) or config.hidden_size,
            draft_vocab_size=getattr(config, "draft_vocab_size", None) or config.vocab_size,
            fc_norm=bool(getattr(config, "fc_norm", False) or getattr(config, "use_aux_norm", False)),
            norm_output=bool(getattr(config, "norm_output", False)),
        )


class Eagle3Draft(nn.Module, ABC):
    """Base of the EAGLE3 draft models; a subclass supplies its one decoder layer
    (`decoder_layer`) and its checkpoint names (`weight_map`)."""

    # Fields config.json must state itself (the loader refuses a checkpoint without them): a
    # config class fills gaps with defaults that describe another model (DeepseekV3Config's are
    # DeepSeek-V3 671B's MLA dims).
    stated_config_fields: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "intermediate_size",
                                                       "num_attention_heads")

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "num_hidden_layers", 1) != 1:
            raise ValueError(f"draft config: num_hidden_layers is {config.num_hidden_layers}; "
                             "EAGLE3 drafts have exactly one decoder layer")
        self.config = config
        self.eagle = Eagle3Config.from_hf(config)
        hidden = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden)
        self.fc = Linear(self.eagle.num_aux * self.eagle.target_hidden_size, hidden,
                         bias=bool(getattr(config, "bias", False)))
        self.fc_norm = nn.ModuleList(
            RMSNorm(self.eagle.target_hidden_size, config.rms_norm_eps) for _ in range(self.eagle.num_aux)
        ) if self.eagle.fc_norm else None
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = LMHead(hidden, self.eagle.draft_vocab_size, what="draft_vocab_size")
        if self.eagle.draft_vocab_size != config.vocab_size:
            # target id = draft id + d2t[draft id] (the EAGLE/SpecForge convention)
            self.d2t = nn.Parameter(torch.zeros(self.eagle.draft_vocab_size, dtype=torch.long), requires_grad=False)
        else:
            self.d2t = None

    @abstractmethod
    def decoder_layer(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """The draft's one layer: pre-norm output [T, H]."""

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the target's aux hidden states [T, num_aux * H_target]; fc_norm touches only these."""
        if self.fc_norm is not None:
            chunks = aux.chunk(self.eagle.num_aux, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(post_norm, pre_norm) hidden states: logits come from the first, the carry from `carry`."""
        out = self.decoder_layer(self.embed_tokens(input_ids), hidden, positions, meta)
        return self.norm(out), out

    def carry(self, post_norm: torch.Tensor, pre_norm: torch.Tensor) -> torch.Tensor:
        return post_norm if self.eagle.norm_output else pre_norm

    def compute_logits(self, post_norm: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the draft vocabulary."""
        return self.lm_head(post_norm)

    def draft_token_ids(self, post_norm: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens, as target vocabulary ids."""
        ids = greedy_tokens(self.compute_logits(post_norm))
        return ids if self.d2t is None else ids + self.d2t[ids]

    def attention_layers(self) -> list[CachedAttention]:
        return [m for m in self.modules() if isinstance(m, CachedAttention)]

    def share_target_weights(self, missing: Sequence[str], embed: torch.Tensor, head: torch.Tensor) -> None:
        """Borrow the target's embedding / lm_head for the ones the draft checkpoint lacks."""
        if "embed_tokens.weight" in missing:
            if embed.shape != self.embed_tokens.weight.shape:
                raise ValueError(f"the draft checkpoint has no embed_tokens.weight and its embedding "
                                 f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size) differs "
                                 f"from the target's {tuple(embed.shape)}")
            self.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
        if "lm_head.weight" in missing:
            if self.eagle.draft_vocab_size != self.config.vocab_size:  # = the target's (checked by the builder)
                raise ValueError(f"the draft checkpoint has no lm_head.weight and its draft_vocab_size "
                                 f"{self.eagle.draft_vocab_size} differs from the target's vocabulary {self.config.vocab_size}")
            self.lm_head.weight = nn.Parameter(head, requires_grad=False)
