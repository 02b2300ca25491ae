"""What the engine needs from a target model, and what speculative decoding needs from it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.kv_scales import KV_SCALE_SKIP
from atom_like.loader.weights import WeightMap
from model_ops.attention.layer import CachedAttention
from model_ops.attention.metadata import AttentionMetadata
from model_ops.embed_head import LMHead, VocabEmbedding
from model_ops.layernorm import RMSNorm
from spec_decode.aux_layers import AuxHiddenStates, resolve_aux_layer_ids


class CausalLM(nn.Module, ABC):
    config: PretrainedConfig  # the language-model config (text_config for wrappers)
    # Fields the checkpoint's config.json must state itself, checked by name before anything is
    # built: a config class fills a gap with another model's default (DeepseekV3Config's are the
    # 671B model's), which would surface later as a tensor-shape error or a huge allocation.
    stated_config_fields: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

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
    """A target an EAGLE3 draft can run on (the interface of sgl-project/sglang#19689 and
    ROCm/ATOM#631; id conventions of sgl-project/sglang#25454).

    Flow: `set_eagle3_layers_to_capture(draft ids or None)`, then engine/speculative.py
    allocates `AuxHiddenStates(target.eagle3_aux_layer_ids, ...)` and binds it; every forward
    then fills it.
    """

    def set_eagle3_layers_to_capture(self, layer_ids: Sequence[int] | None) -> None:
        """Resolve the draft's aux layer ids (None: defaults); unbinds a buffer laid out for other ids."""

    @property
    def eagle3_aux_layer_ids(self) -> list[int]:
        """The resolved capture ids (input-of-layer convention); empty when capture is off."""

    def bind_aux_hidden_states(self, aux: AuxHiddenStates | None) -> None:
        """Capture into `aux` on every forward from now on (None: stop capturing)."""

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding weight [vocab, H], lm_head weight [vocab, H])."""

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Replace both weights (shared, not copied), e.g. to give a draft the target's."""


def run_decoder_layers(layers: nn.ModuleList, norm: RMSNorm, hidden: torch.Tensor,
                       cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                       aux: AuxHiddenStates | None) -> torch.Tensor:
    """The pre-norm residual decoder stack shared by Llama and DeepSeek (LlamaDecoderLayer). Each
    block's input norm runs here: it all-reduces the block before's MLP partial sums, adds them
    to the residual stream and normalizes (one fused kernel under tensor parallelism where
    model_ops.tp can), and the stream it yields is what EAGLE3 captures for that layer (after the
    all-reduce, as the seed design says); the final norm closes the stack the same way."""
    residual = hidden  # the embeddings: the stream entering layer 0
    for index, layer in enumerate(layers):
        if index == 0:
            normed = layer.input_layernorm(hidden)
        else:
            normed, residual = layer.input_layernorm.reduce_add_forward(hidden, residual)
        if aux is not None:
            aux.capture(index, residual)  # copies: the next norm updates the stream in place
        hidden, residual = layer(normed, residual, cos_sin, meta)
    normed, residual = norm.reduce_add_forward(hidden, residual)
    if aux is not None:
        aux.capture(len(layers), residual)
    return normed


class DecoderModel(nn.Module):
    """The inner `model` of a decoder-only CausalLM: embeddings, a stack of pre-norm residual
    layers sharing one rotary embedding, a final norm, and the `aux` slot Eagle3TargetMixin binds.
    Subclasses build `embed_tokens`, `rotary`, `layers` and `norm`."""

    embed_tokens: VocabEmbedding
    rotary: nn.Module
    layers: nn.ModuleList
    norm: RMSNorm

    def __init__(self) -> None:
        super().__init__()
        self.aux: AuxHiddenStates | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        return run_decoder_layers(self.layers, self.norm, hidden, cos_sin, meta, self.aux)


class Eagle3TargetMixin:
    """Eagle3Target, written once for CausalLMs with `self.model` (a DecoderModel whose forward
    fills its `aux` slot) and `self.lm_head`."""

    config: PretrainedConfig
    model: DecoderModel
    lm_head: LMHead
    _aux_layer_ids: list[int] = []  # per instance once set; empty = capture off

    def set_eagle3_layers_to_capture(self, layer_ids: Sequence[int] | None) -> None:
        self._aux_layer_ids = resolve_aux_layer_ids(layer_ids, self.config.num_hidden_layers)
        if self.model.aux is not None and self.model.aux.layer_ids != self._aux_layer_ids:
            self.model.aux = None  # a buffer laid out for other layers would be read wrongly

    @property
    def eagle3_aux_layer_ids(self) -> list[int]:
        return list(self._aux_layer_ids)

    def bind_aux_hidden_states(self, aux: AuxHiddenStates | None) -> None:
        if aux is not None:
            if not self._aux_layer_ids:
                raise ValueError("bind_aux_hidden_states before set_eagle3_layers_to_capture: no layers to capture")
            if aux.layer_ids != self._aux_layer_ids:
                raise ValueError(f"AuxHiddenStates captures layers {aux.layer_ids} but the target resolved "
                                 f"{self._aux_layer_ids}: build it from target.eagle3_aux_layer_ids")
            if aux.hidden_size != self.config.hidden_size:
                raise ValueError(f"AuxHiddenStates hidden_size {aux.hidden_size} != the target's "
                                 f"{self.config.hidden_size}")
        self.model.aux = aux

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        for name, new, old in (("embed", embed, self.model.embed_tokens.weight), ("head", head, self.lm_head.weight)):
            if new.shape != old.shape:
                raise ValueError(f"set_embed_and_head: {name} has shape {tuple(new.shape)}, "
                                 f"expected {tuple(old.shape)}")
        self.model.embed_tokens.weight = _as_parameter(embed)
        self.lm_head.weight = _as_parameter(head)


def _as_parameter(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


class DecoderOnlyLM(Eagle3TargetMixin, CausalLM):
    """A decoder stack `model` (a DecoderModel) under an LM head, tied to its embedding when the
    config says so: what Llama and DeepSeek share."""

    def __init__(self, config: PretrainedConfig, model: DecoderModel):
        super().__init__()
        self.config = config
        self.model = model
        tied = model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def common_skips(self) -> list[tuple[str, str]]:
        """Checkpoint tensors every such model ignores."""
        skip = [("rotary_emb.inv_freq", "rotary frequency buffers (recomputed from the config)"), KV_SCALE_SKIP]
        if self.config.tie_word_embeddings:
            skip.append(("lm_head.weight", "lm_head.weight (tied to embed_tokens)"))
        return skip
