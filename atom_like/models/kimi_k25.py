"""Kimi-K2.5 / K2.6 (KimiK25ForConditionalGeneration): the text path of the multimodal wrapper.

The language model is a DeepSeek-V3 (`text_config`); the vision tower and projector are not
built and their weights are skipped. Checkpoint layouts, all mapped onto `language_model.*`:

* hub release: `language_model.model.layers.*`, `language_model.lm_head.weight`
* transformers 5.x save_pretrained: the same, except that its reversed `blocks -> layers`
  vision rename also hits the text layers: `language_model.model.blocks.*` (seen with 5.23)
* transformers' in-memory names: `model.language_model.*`, `lm_head.weight`

The engine builds models from the text config, so lm_head tying follows
text_config.tie_word_embeddings; transformers ties by the wrapper's top-level flag. Both are
false in the released Kimi-K2.5 config (tests keep them equal).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from atom_like.loader.weights import WeightMap
from atom_like.models.base import CausalLM, Eagle3Target
from atom_like.models.deepseek_v2 import DeepseekV3ForCausalLM
from spec_decode.aux_layers import AuxHiddenStates

_LAYOUTS = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)
# names a quantization config may use for the language model's modules: the other checkpoint
# layouts, and the text model's own names (ATOM maps language_model.model. -> model. the same way)
_CONFIG_ALIASES = (
    ("language_model.model.layers.", "language_model.model.blocks."),
    ("language_model.model.", "model.language_model."),
    ("language_model.model.", "model."),
)
_SKIP = (
    ("vision_tower.", "vision tower (text path only)"),
    ("mm_projector.", "multimodal projector (text path only)"),
)


class KimiK25ForConditionalGeneration(CausalLM):
    # without text_config, Kimi_K25Config would build DeepSeek-V3 671B's defaults
    stated_config_fields = ("text_config", *(f"text_config.{f}" for f in DeepseekV3ForCausalLM.stated_config_fields))

    def __init__(self, config: PretrainedConfig):
        """`config` is the wrapper's config or its text_config (the engine passes the latter)."""
        super().__init__()
        self.config = config.get_text_config()
        self.language_model = DeepseekV3ForCausalLM(self.config)

    def forward(self, input_ids, positions, meta):
        return self.language_model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def weight_map(self) -> WeightMap:
        inner = self.language_model.weight_map()
        return replace(inner, prefix_renames=_LAYOUTS, skip=inner.skip + _SKIP, config_aliases=_CONFIG_ALIASES)

    # ---------------------------------------------------------------- Eagle3Target, by delegation

    def _eagle3_target(self) -> Eagle3Target:
        """The language model, which must implement Eagle3Target (sgl-project/sglang#19689 delegates the same way: say so, clearly)."""
        if not isinstance(self.language_model, Eagle3Target):
            raise TypeError(f"{type(self).__name__} cannot be an EAGLE3 target: its language model "
                            f"{type(self.language_model).__name__} does not implement Eagle3Target "
                            "(set_eagle3_layers_to_capture, eagle3_aux_layer_ids, bind_aux_hidden_states, "
                            "get_embed_and_head, set_embed_and_head)")
        return self.language_model

    def set_eagle3_layers_to_capture(self, layer_ids: Sequence[int] | None) -> None:
        self._eagle3_target().set_eagle3_layers_to_capture(layer_ids)

    @property
    def eagle3_aux_layer_ids(self) -> list[int]:
        return self._eagle3_target().eagle3_aux_layer_ids

    def bind_aux_hidden_states(self, aux: AuxHiddenStates | None) -> None:
        self._eagle3_target().bind_aux_hidden_states(aux)

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._eagle3_target().get_embed_and_head()

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        self._eagle3_target().set_embed_and_head(embed, head)
