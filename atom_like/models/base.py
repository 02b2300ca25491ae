"""What the engine needs from a target model."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.weights import WeightMap
from model_ops.attention.layer import CachedAttention
from model_ops.attention.metadata import AttentionMetadata


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
