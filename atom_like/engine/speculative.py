"""Builds the EAGLE3 proposer for a target: loads the draft, checks it fits the target, points
the target's aux capture at the layers the draft was trained on."""
from __future__ import annotations

import logging

import torch

from atom_like.config import EngineArgs, load_model_config, require_stated_fields
from atom_like.loader.dummy import init_dummy_weights
from atom_like.loader.kv_scales import read_kv_scales
from atom_like.loader.weights import checkpoint_keys, iter_checkpoint, load_weights
from atom_like.models.base import CausalLM, Eagle3Target
from atom_like.models.registry import build_model, draft_model_class
from model_ops.quant.fp8 import FP8_KV_DTYPES
from spec_decode.aux_layers import AuxHiddenStates
from spec_decode.proposer import Eagle3Proposer

logger = logging.getLogger(__name__)


def build_eagle3_proposer(args: EngineArgs, target: CausalLM, dtype: torch.dtype, device: torch.device,
                          kv_cache_dtype: torch.dtype) -> Eagle3Proposer:
    """`kv_cache_dtype`: the draft's KV cache matches the target's (fp8 scales from the draft's
    own checkpoint, else 1.0)."""
    if not isinstance(target, Eagle3Target):
        raise ValueError(f"{type(target).__name__} cannot serve as an EAGLE3 target (no aux hidden-state capture)")
    config = load_model_config(args.draft_model, args.trust_remote_code)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{args.draft_model}/config.json has a quantization_config: quantized EAGLE3 drafts are "
                         "not supported (drafts load in the model dtype)")
    cls = draft_model_class(config)
    require_stated_fields(config, args.draft_model, cls.stated_config_fields, cls.__name__)
    draft = build_model(cls, config, dtype, device)
    eagle, tcfg = draft.eagle, target.config
    if eagle.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"draft target_hidden_size {eagle.target_hidden_size} != target hidden_size {tcfg.hidden_size}")
    if config.vocab_size != tcfg.vocab_size:
        raise ValueError(f"draft vocab_size {config.vocab_size} != target vocab_size {tcfg.vocab_size}")
    dummy = args.load_format == "dummy"  # every draft weight seeded random, its d2t the identity
    if not dummy and draft.d2t is not None and "d2t" not in checkpoint_keys(args.draft_model):
        raise ValueError(f"draft_vocab_size {eagle.draft_vocab_size} differs from the vocabulary {config.vocab_size} "
                         "but the draft checkpoint has no d2t mapping")
    weight_map = draft.weight_map()
    if dummy:
        init_dummy_weights(draft, args.seed)
        missing = []
    else:
        missing = load_weights(draft, iter_checkpoint(args.draft_model, "Loading draft"), weight_map)
    if missing:
        logger.info("draft checkpoint lacks %s: sharing the target's", missing)
        draft.share_target_weights(missing, *target.get_embed_and_head())

    target.set_eagle3_layers_to_capture(eagle.aux_layer_ids)
    ids = target.eagle3_aux_layer_ids
    if len(ids) != eagle.num_aux:
        raise ValueError(f"draft fc reads {eagle.num_aux} aux hidden states but eagle_aux_hidden_state_layer_ids gives {ids}")
    aux = AuxHiddenStates(ids, args.max_num_batched_tokens, tcfg.hidden_size, dtype, device)
    target.bind_aux_hidden_states(aux)
    logger.info("EAGLE3 draft %s: k=%d, aux layers %s, fc_norm=%s, norm_output=%s, draft vocab %d",
                args.draft_model, args.num_speculative_tokens, ids, eagle.fc_norm, eagle.norm_output,
                eagle.draft_vocab_size)
    kv_scales = (read_kv_scales(args.draft_model, draft, draft.attention_layers(), weight_map, "draft")
                 if kv_cache_dtype in FP8_KV_DTYPES and not dummy else None)
    return Eagle3Proposer(draft, aux, args.num_speculative_tokens, args.block_size, dtype, device,
                          args.attention_backend, kv_cache_dtype, kv_scales)
