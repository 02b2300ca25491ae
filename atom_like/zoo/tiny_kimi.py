"""tiny-kimi: a Kimi-K2.5-architecture model small enough to train in minutes and ship in the package.

Why: no Kimi or DeepSeek (MLA) weights exist offline, and the engine's MLA + MoE + EAGLE3 paths
need a trained model of exactly that shape to show real acceptance numbers. tiny-kimi keeps
every architectural feature the engine must get right and shrinks only the sizes:
  * top level: ``model_type: kimi_k25``, ``KimiK25ForConditionalGeneration``, a small
    ``vision_config`` that is never trained and whose weights are not shipped;
  * ``text_config`` (``model_type: kimi_k2`` = DeepSeek-V3): MLA with ``q_lora_rank`` set,
    interleaved RoPE with DeepSeek YaRN (``rope_scaling``, so softmax scale gets mscale^2), a
    first dense layer, MoE with one shared expert, sigmoid scoring + ``e_score_correction_bias``
    (noaux_tc), group-limited routing (``n_group``/``topk_group``), normalised top-k weights times
    ``routed_scaling_factor``.

Training uses transformers' own ``DeepseekV3ForCausalLM`` on the text config; ``export`` writes
the real checkpoint layout (``language_model.model.*``, ``language_model.lm_head.weight``,
one tensor per expert, the correction bias in fp32), which transformers' ``Kimi_K25`` loader and
the engine read, and ``load_text_model`` reads it back for draft training.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from atom_like.zoo.checkpoint import load_tensors, save_sharded

# Sizes: target + three drafts must fit in 40 MB of bf16 (see atom_like/zoo/README.md); 5 layers
# is the fewest that gives three EAGLE3 aux layers in 2..N-1 (eagle3_reference.training_aux_layer_ids).
# rms_norm_eps is 1e-6 because transformers' DeepseekV3Attention normalises the q/kv latents with
# a fixed 1e-6 while vLLM/sglang use the config's eps: with 1e-6 everywhere both readings agree.
TEXT_DEFAULTS = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=112, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
    first_k_dense_replace=1, routed_scaling_factor=2.827, rms_norm_eps=1e-6, rope_theta=50000.0,
    max_position_embeddings=4096,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
)
VISION_CONFIG = dict(patch_size=14, num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                     intermediate_size=128, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1,
                     merge_kernel_size=[2, 2])
# Keys of the checkpoint format that transformers' DeepseekV3Config does not model.
_CHECKPOINT_ONLY = ("model_type", "architectures", "topk_method", "scoring_func", "moe_layer_freq",
                    "num_nextn_predict_layers")


def text_config(tok, **overrides) -> dict:
    """The ``text_config`` dict as a Kimi/DeepSeek checkpoint writes it (``rope_scaling``, ``kimi_k2``)."""
    cfg = dict(TEXT_DEFAULTS)
    cfg.update(overrides)
    cfg.update(
        model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], vocab_size=len(tok),
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, moe_layer_freq=1,
        num_nextn_predict_layers=0, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
        tie_word_embeddings=False, initializer_range=0.02, use_cache=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return cfg


def kimi_config(text_cfg: dict, tok) -> dict:
    """Top-level ``kimi_k25`` config around ``text_cfg`` (media token ids point at our specials)."""
    ids = tok.convert_tokens_to_ids
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text_cfg, "vision_config": dict(VISION_CONFIG),
        "projection_hidden_size": VISION_CONFIG["hidden_size"], "projection_layer_norm_eps": 1e-5,
        "image_token_id": ids("<|media_pad|>"), "video_token_id": ids("<|media_content|>"),
        "vision_start_token_id": ids("<|media_start|>"), "vision_end_token_id": ids("<|media_end|>"),
        "media_placeholder_token_id": ids("<|media_pad|>"), "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    }


def hf_text_config(text_cfg: dict):
    """transformers' ``DeepseekV3Config`` for a checkpoint ``text_config`` dict."""
    from transformers import DeepseekV3Config

    if text_cfg.get("q_lora_rank") is None:
        raise ValueError("tiny-kimi needs q_lora_rank (Kimi's MLA uses the q-LoRA path)")
    return DeepseekV3Config(**{k: v for k, v in text_cfg.items() if k not in _CHECKPOINT_ONLY})


def build_model(text_cfg: dict, seed: int = 0):
    """A freshly initialised ``DeepseekV3ForCausalLM`` (fp32) for ``text_cfg``."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(hf_text_config(text_cfg))


def to_checkpoint_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers state dict -> Kimi checkpoint tensors (prefixed, experts split, bf16/fp32)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        name = "language_model." + key
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            base = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e].to(torch.bfloat16)
                out[f"{base}{e}.up_proj.weight"] = up[e].to(torch.bfloat16)
        elif key.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].to(torch.bfloat16)
        elif key.endswith("e_score_correction_bias"):
            out[name] = t.to(torch.float32)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def from_checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``to_checkpoint_tensors`` (vision / projector tensors, if any, are ignored)."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    for name, t in tensors.items():
        if not name.startswith("language_model."):
            continue
        key = name[len("language_model."):]
        m = pattern.match(key)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            state[key] = t
    for base, per in experts.items():
        order = [per[e] for e in sorted(per)]
        state[f"{base}.gate_up_proj"] = torch.stack([torch.cat([p["gate"], p["up"]], dim=0) for p in order])
        state[f"{base}.down_proj"] = torch.stack([p["down"] for p in order])
    return state


def export(model, config: dict, tokenizer_dir: Path, out_dir: Path, manifest: dict) -> list[Path]:
    """Write a trained text model as a tiny-kimi folder (config, weights, tokenizer, zoo.json)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = save_sharded(to_checkpoint_tensors(model.state_dict()), out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    from atom_like.zoo.kimi_tokenizer import load

    tok = load(tokenizer_dir)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
           "pad_token_id": tok.pad_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, out_dir / f.name)
    (out_dir / "zoo.json").write_text(json.dumps(manifest, indent=2))
    return files


def load_text_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """The text model of a tiny-kimi (or any kimi_k25 / DeepSeek-V3) folder as ``DeepseekV3ForCausalLM``.

    Reads the checkpoint layout directly, so it needs neither the Kimi_K25 classes nor the
    vision weights.
    """
    from transformers import DeepseekV3ForCausalLM

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    model = DeepseekV3ForCausalLM(hf_text_config(cfg.get("text_config", cfg)))
    model.load_state_dict(from_checkpoint_tensors(load_tensors(model_dir)), strict=True)
    return keep_router_bias_fp32(model.to(dtype)).eval()


def keep_router_bias_fp32(model):
    """Put every ``e_score_correction_bias`` back in fp32 after a dtype cast.

    transformers keeps it fp32 when loading (``_keep_in_fp32_modules_strict``); a plain
    ``.to(bfloat16)`` would round it and can flip expert choices that the bias decides.
    """
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.data = bias.data.float()
    return model


def verify_with_kimi_k25(model_dir: Path, reference, seq_len: int = 24) -> float:
    """Load ``model_dir`` with transformers' ``Kimi_K25ForConditionalGeneration`` and return the max
    |logit difference| to ``reference`` (a DeepseekV3ForCausalLM holding the same weights) in fp32.

    This is the proof that the exported layout and config are what transformers expects.
    """
    from transformers import Kimi_K25ForConditionalGeneration

    kimi = Kimi_K25ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ref = reference.float().eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ref.config.vocab_size, (2, seq_len), generator=gen)
    with torch.no_grad():
        a = kimi(input_ids=ids).logits
        b = ref(input_ids=ids).logits
    return (a - b).abs().max().item()
