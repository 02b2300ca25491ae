"""What the engine needs from a target model."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.weights import WeightMap
from model_ops.attention.layer import CachedAttention
from model_ops.attention.metadata import AttentionMetadata
from spec_decode.aux_layers import AuxHiddenStates, resolve_aux_layer_ids


class CausalLM(nn.Module, ABC):
    config: PretrainedConfig  # the language-model config (text_config for wrappers)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, H] for a flat batch of T tokens."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for selected rows of `forward`'s output."""

    @abstractmethod
    def weight_map(self) -> WeightMap:
        """How checkpoint tensor names map onto this module's parameters."""

    def attention_layers(self) -> list[CachedAttention]:
        return [m for m in self.modules() if isinstance(m, CachedAttention)]


@runtime_checkable
class Eagle3Target(Protocol):
    """A target an EAGLE3 draft can run against (seeds 002, 003, 004)."""

    def set_eagle3_layers_to_capture(self, layer_ids: Sequence[int] | None) -> None: ...

    @property
    def eagle3_aux_layer_ids(self) -> list[int]: ...

    def bind_aux_hidden_states(self, aux: AuxHiddenStates | None) -> None: ...

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None: ...


class Eagle3TargetMixin:
    """Eagle3Target for decoder-only models whose CausalLM has `.model` (with `embed_tokens` and
    an `aux` slot its decoder loop writes through `capture_aux`) and `.lm_head`."""

    _aux_layer_ids: list[int] = []

    def set_eagle3_layers_to_capture(self, layer_ids: Sequence[int] | None) -> None:
        self._aux_layer_ids = resolve_aux_layer_ids(layer_ids, self.config.num_hidden_layers)

    @property
    def eagle3_aux_layer_ids(self) -> list[int]:
        return list(self._aux_layer_ids)

    def bind_aux_hidden_states(self, aux: AuxHiddenStates | None) -> None:
        if aux is not None and aux.layer_ids != self._aux_layer_ids:
            raise ValueError(f"aux buffer captures layers {aux.layer_ids}, the model was set to {self._aux_layer_ids}")
        self.model.aux = aux

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        self.model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)


def capture_aux(aux: AuxHiddenStates | None, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Record the residual stream entering layer `layer_idx` if a draft reads it."""
    if aux is not None and layer_idx in aux.layer_ids:
        aux.capture(layer_idx, hidden if residual is None else hidden + residual)
