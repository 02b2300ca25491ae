"""Incremental detokenization and stop strings.

Decoding the growing token list in a window (a few earlier tokens for context, then the new
ones) and keeping only the new characters gives the same text as decoding everything at once,
including tokenizers that drop a leading space at the start of a decode, and holds back a
partial UTF-8 character until its last byte arrives.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

CONTEXT_TOKENS = 6


def ids_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, called straight on the Rust tokenizer
    when that is all transformers' decode would do (a fast tokenizer that overrides no decode
    method and cleans up no spaces): its Python wrapper costs ~25 calls a decode, and every
    generated token takes two, so at large batches it was most of a decode step's host work."""
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=8)
def skipped_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The special tokens that decoding with skip_special_tokens drops wherever they stand."""
    decode = ids_decoder(tokenizer)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return frozenset(i for i in special if decode([i]) == "")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], stop: list[str]):
        self._decode = ids_decoder(tokenizer)
        # Skipped tokens never enter the window: a token that adds no text leaves the offsets where
        # they are (it may be the first byte of a character), so a run of them (an ignore_eos
        # request repeating EOS) grew the window by one a token, and each token's decodes with it:
        # 110 µs a token after 4,000 EOS with SmolLM2's tokenizer, for every such request in a batch.
        self._skipped = skipped_ids(tokenizer)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one generated token; True when a stop string completed (text is cut before it).
        With `check_stop` False the text grows and no stop string is looked for."""
        if token_id in self._skipped:
            return False
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        before = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for s in self.stop if check_stop else ():
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                return True
        return False
