"""Loading a zoo target (SmolLM2 or tiny-kimi) as a transformers causal LM, with its tokenizer.

Why one loader: the draft trainer, the acceptance evaluator and the regeneration step all need
"the target, its tokenizer, and the tokens that end a reply", for a Llama HF folder and for a
tiny-kimi (``kimi_k25``) folder alike. tiny-kimi is read into transformers' own
``DeepseekV3ForCausalLM`` (text model only), so nothing here depends on the Kimi_K25 classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def zoo_path(name_or_dir) -> Path:
    """A zoo model name (resolved, SmolLM2 converted on demand) or a folder."""
    from atom_like.zoo.registry import MODELS, resolve

    return resolve(name_or_dir) if str(name_or_dir) in MODELS else Path(name_or_dir)


def stop_token_ids(model_dir: Path, tok) -> list[int]:
    """Tokens that end a reply: the generation config's eos ids, the tokenizer's eos, ``<|im_end|>``."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    ids.append(tok.eos_token_id)
    if "<|im_end|>" in tok.get_vocab():
        ids.append(tok.convert_tokens_to_ids("<|im_end|>"))
    return sorted({int(i) for i in ids if i is not None})


def load_target(name_or_dir, dtype: torch.dtype = torch.float32, device="cpu"):
    """-> (model in eval mode on ``device``, tokenizer, stop token ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo_path(name_or_dir)
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") == "kimi_k25":
        from atom_like.zoo.tiny_kimi import load_text_model

        model = load_text_model(path, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    if str(device) == "cpu" and getattr(model.config, "n_routed_experts", None):
        model.set_experts_implementation("eager")  # transformers' grouped_mm is many times slower on CPU
    tok = AutoTokenizer.from_pretrained(str(path))
    return model.to(device).eval(), tok, stop_token_ids(path, tok)

