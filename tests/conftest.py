"""Shared fixtures: tiny random-init checkpoints written by transformers itself, so every test
compares the engine against the model code users would otherwise run."""
from __future__ import annotations

import json
import os

import pytest
import torch

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
