"""tiny-kimi's tokenizer: a byte-level BPE trained on the zoo's own text, with Kimi's chat tokens.

Why not the real Kimi or DeepSeek tokenizer: their 129k-164k vocabularies would make the
embedding and LM head of a ~9M-parameter model most of its size (the whole tiny-kimi family
must fit in 40 MB). A small BPE trained on the same ShareGPT + GSM8K text keeps the vocabulary
useful, and the special tokens and chat layout follow Kimi-K2 so that prompts look like the real
model's: ``<|im_user|>user<|im_middle|>...<|im_end|>``. Digits are split one per token (as
DeepSeek and Kimi do), which helps the small model with GSM8K arithmetic.

The result is a ``tokenizer.json`` + ``tokenizer_config.json`` (with the jinja chat template)
that ``transformers.AutoTokenizer`` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

# Order fixes the ids: [PAD]=0, [BOS]=1, [EOS]=2, then the chat and media tokens.
SPECIAL_TOKENS = ["[PAD]", "[BOS]", "[EOS]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                  "<|im_middle|>", "<|im_end|>", "<|media_start|>", "<|media_content|>",
                  "<|media_end|>", "<|media_pad|>"]
CHAT_TOKENS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]

# Kimi-K2 layout without its default system prompt (saves tokens for a small model); BOS opens
# every conversation so that packed training sequences mark where a conversation starts.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- endif -%}"
    "{{- message['content'] -}}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path, model_max_length: int = 1 << 20):
    """Train the BPE on ``texts`` and save it to ``out_dir``; returns the loaded HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                                  model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[3:]})
    tok.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return load(out_dir)


def load(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

