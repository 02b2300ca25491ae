"""Micro models and data for the zoo's CPU tests: seconds to build, no downloads, no big packages.

A tiny BPE (trained on generated sentences), a micro Llama target and a micro tiny-kimi target
(random weights, saved in the real folder layouts), and chat shards, all under a temp folder.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from atom_like.zoo import kimi_tokenizer, tiny_kimi
from eagle3_train import shards

def single_thread():
    """Module fixture body: micro models are overhead-bound, and extra intra-op threads only add
    synchronisation (10x slower on a loaded 2-core CI machine), so zoo tests run on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_WORDS = ("the cat dog bird sat ran on under over a mat tree house quickly slowly red blue green "
          "one two three four five plus minus is what how many apples does have").split()


def chats(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
        out.append([{"role": "user", "content": f"What is {a} plus {b}? {q}"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}. " + " ".join(rng.choice(_WORDS) for _ in range(6))}])
    return out


def tokenizer(tmp: Path, vocab: int = 320):
    texts = [m["content"] for c in chats(400) for m in c]
    return kimi_tokenizer.train_tokenizer(texts, vocab, Path(tmp) / "tok")


def data(tmp: Path, tok, n: int = 60, name: str = "train") -> Path:
    folder = Path(tmp) / "data"
    shards.write_shards((shards.encode_chat(tok, c) for c in chats(n, seed=1)), folder, name, tok)
    return folder


def _write_tokenizer(tok, out: Path, im_end: int):
    import json

    tok.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end, "pad_token_id": tok.pad_token_id}))
    (out / "zoo.json").write_text("{}")


def llama_target(tmp: Path, tok, layers: int = 5, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    out = Path(tmp) / "llama_target"
    model.save_pretrained(str(out))
    _write_tokenizer(tok, out, tok.convert_tokens_to_ids("<|im_end|>"))
    return out


MICRO_KIMI = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
                  num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_group=2,
                  topk_group=1, max_position_embeddings=1024,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def kimi_target(tmp: Path, tok, seed: int = 0) -> tuple[Path, object]:
    """A micro tiny-kimi folder (random weights, non-zero router bias) and its DeepseekV3 model."""
    text = tiny_kimi.text_config(tok, **MICRO_KIMI)
    model = tiny_kimi.build_model(text, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    model = tiny_kimi.keep_router_bias_fp32(model.to(torch.bfloat16).float())  # what the bf16 export holds
    out = Path(tmp) / "kimi_target"
    tiny_kimi.export(model, tiny_kimi.kimi_config(text, tok), Path(tmp) / "tok", out, {"micro": True})
    return out, model


def kimi_data(tmp: Path, tok) -> Path:
    """A build_data-style tiny-kimi folder: tokenizer/ plus sharegpt, gsm8k and heldout sets."""
    import shutil

    folder = Path(tmp) / "kimi_data"
    shutil.copytree(Path(tmp) / "tok", folder / "tokenizer", dirs_exist_ok=True)
    for name, seed in (("sharegpt", 1), ("gsm8k", 2), ("heldout", 3)):
        shards.write_shards((shards.encode_chat(tok, c) for c in chats(40, seed=seed)), folder, name, tok)
    return folder


def eval_prompts(tmp: Path, n: int = 3) -> Path:
    import json

    path = Path(tmp) / "eval_prompts.jsonl"
    path.write_text("\n".join(json.dumps({"set": s, "messages": c[:1]})
                              for s, seed in (("sharegpt", 7), ("gsm8k", 8)) for c in chats(n, seed=seed)))
    return path
