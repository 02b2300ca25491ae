"""Incremental detokenization and stop strings.

Decoding the growing token list in a window (a few earlier tokens for context, then the new
ones) and keeping only the new characters gives the same text as decoding everything at once,
including tokenizers that drop a leading space at the start of a decode, and holds back a
partial UTF-8 character until its last byte arrives.
"""
from __future__ import annotations

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


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], stop: list[str]):
        self._decode = ids_decoder(tokenizer)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one generated token; True when a stop string completed (text is cut before it).
        With `check_stop` False the text grows and no stop string is looked for."""
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
