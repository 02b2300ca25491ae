"""Shared fixtures: tiny random-init checkpoints written by transformers itself, so every test
compares the engine against the model code users would otherwise run.

CPU CI runs the Triton kernels in the interpreter. Triton reads TRITON_INTERPRET when a kernel
is decorated, so it is set here, before any test module imports triton.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over w0..w{V-1}; token 0 doubles as eos so stop tests have one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0", unk_token="w1")
    # For the chat endpoint: each message's content after a role marker; words outside the vocab
    # (the role names) encode as the unk token, which is all a random model needs.
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant{% endif %}")
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def make_llama(tmp_path_factory):
    """Factory: make_llama(**config overrides, tokenizer=False) -> checkpoint folder (cached)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cache: dict[str, str] = {}

    def make(tokenizer: bool = False, seed: int = 0, **overrides) -> str:
        key = json.dumps([tokenizer, seed, sorted(overrides.items())], default=str)
        if key not in cache:
            torch.manual_seed(seed)
            config = LlamaConfig(**{**TINY_LLAMA, **overrides})
            model = LlamaForCausalLM(config).eval()
            # transformers initialises with std 0.02: make logits less flat so greedy ties are rare
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0, 0.15)
            path = str(tmp_path_factory.mktemp("llama"))
            model.save_pretrained(path)
            if tokenizer:
                _save_tokenizer(path, config.vocab_size)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_path(make_llama) -> str:
    return make_llama()


def write_eagle3_llama_draft(path: str, target_path: str, *, seed: int = 0, hidden_size: int | None = None,
                             draft_vocab_size: int | None = None, aux_layer_ids=None, fc_norm: bool = False,
                             legacy_aux_norm: bool = False, norm_output: bool = False, with_embed: bool = True,
                             layer_prefix: str = "midlayer.") -> str:
    """A random-init LlamaForCausalLMEagle3 checkpoint in the lightseekorg/SpecForge layout,
    written tensor by tensor (independently of the engine's model code)."""
    from safetensors.torch import save_file

    target = json.load(open(os.path.join(target_path, "config.json")))
    ht, vocab = target["hidden_size"], target["vocab_size"]
    h = hidden_size or ht
    heads, kv_heads, head_dim, inter = 4, 2, h // 4, 2 * h
    dv = draft_vocab_size or vocab
    num_aux = len(aux_layer_ids) if aux_layer_ids else 3
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    p = layer_prefix
    t = {"fc.weight": w(h, num_aux * ht), f"{p}input_layernorm.weight": norm(h), f"{p}hidden_norm.weight": norm(h),
         f"{p}post_attention_layernorm.weight": norm(h),
         f"{p}self_attn.q_proj.weight": w(heads * head_dim, 2 * h), f"{p}self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * h),
         f"{p}self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * h), f"{p}self_attn.o_proj.weight": w(h, heads * head_dim),
         f"{p}mlp.gate_proj.weight": w(inter, h), f"{p}mlp.up_proj.weight": w(inter, h), f"{p}mlp.down_proj.weight": w(h, inter),
         "norm.weight": norm(h), "lm_head.weight": w(dv, h)}
    if with_embed:
        t["embed_tokens.weight"] = w(vocab, h)
    if fc_norm or legacy_aux_norm:
        t.update({f"fc_norm.{i}.weight": norm(ht) for i in range(num_aux)})
    if dv != vocab:
        chosen = torch.randperm(vocab, generator=g)[:dv].sort().values
        t["d2t"] = chosen - torch.arange(dv)
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True)
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": target.get("max_position_embeddings", 512), "vocab_size": vocab,
              "draft_vocab_size": dv, "target_hidden_size": ht, "tie_word_embeddings": False,
              "eagle_config": {"use_aux_hidden_state": True, **({"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)} if aux_layer_ids else {})}}
    if fc_norm:
        config["fc_norm"] = True
    if legacy_aux_norm:
        config["use_aux_norm"] = True
    if norm_output:
        config["norm_output"] = True
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    return path


@pytest.fixture(scope="session")
def make_eagle3_llama(tmp_path_factory):
    """Factory: make_eagle3_llama(target_path, **options of write_eagle3_llama_draft) -> folder (cached)."""
    cache: dict[str, str] = {}

    def make(target_path: str, **options) -> str:
        key = json.dumps([target_path, sorted(options.items())], default=str)
        if key not in cache:
            cache[key] = write_eagle3_llama_draft(str(tmp_path_factory.mktemp("eagle3")), target_path, **options)
        return cache[key]

    return make
