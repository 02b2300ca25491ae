"""Incremental detokenization and stop strings.

Decoding the growing token list in a window (a few earlier tokens for context, then the new
ones) and keeping only the new characters gives the same text as decoding everything at once,
including tokenizers that drop a leading space at the start of a decode, and holds back a
partial UTF-8 character until its last byte arrives. A fast tokenizer whose decode is plain
does this in Rust (tokenizers' DecodeStream: one call a token); any other tokenizer in Python
through its decode (two calls a token).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from atom_like.sampling_params import TextPieces, TextSpan

CONTEXT_TOKENS = 6


def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer when `tokenizer.decode(ids, skip_special_tokens=True)` does nothing but
    call it (a fast tokenizer that overrides no decode method and cleans up no spaces), else None."""
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode):
        return tokenizer.backend_tokenizer
    return None


def ids_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, called straight on the Rust tokenizer
    where that is all it does: its Python wrapper costs ~25 calls a decode, and every generated
    token took two, so at large batches it was most of a decode step's host work."""
    backend = plain_backend(tokenizer)
    if backend is not None:
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
        # Skipped tokens never enter the window: a token that adds no text leaves it open (it may
        # be the first byte of a character), so a run of them (an ignore_eos request repeating
        # EOS) grew the window by one a token, and each token's decodes with it: 110 µs a token
        # after 4,000 EOS with SmolLM2's tokenizer (DecodeStream alike: 188 µs), for every such
        # request in a batch.
        self._skipped = skipped_ids(tokenizer)
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        self._backend = plain_backend(tokenizer)
        if self._backend is not None:
            # the same window in Rust, one call a token (SmolLM2's tokenizer: 2.2 -> 1.1 µs a token)
            self._stream = DecodeStream(skip_special_tokens=True)
            for token_id in context:
                self._stream.step(self._backend, token_id)
        else:  # the window in Python (_window)
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
            self.ids = context
            self.prefix_offset = 0
            self.read_offset = len(self.ids)
        self.stop = stop
        self._longest_stop = max(map(len, stop), default=0)
        # The text as pieces, one a token that added some (TextPieces): appending a piece costs the
        # same however long the text, where `text += new` copied the whole text for every token (an
        # attribute never takes CPython's in-place concatenation): 40 -> 78 µs a step for the
        # detokenizers of 32 requests over 1,400 tokens (CPU, 2026-11-27). Outputs read it (joined)
        # when they are read. A stop replaces the pieces, never cuts them, so the TextSpans of
        # earlier outputs keep reading what they were given.
        self._pieces = TextPieces()

    @property
    def text(self) -> str:
        return self._pieces.text(len(self._pieces))

    def snapshot(self) -> TextSpan:
        """The text so far, read when the output that holds it is first read."""
        return TextSpan(self._pieces, 0, len(self._pieces))

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one generated token; True when a stop string completed (text is cut before it).
        With `check_stop` False the text grows and no stop string is looked for."""
        if token_id in self._skipped:
            return False
        new = self._stream.step(self._backend, token_id) if self._backend is not None else self._window(token_id)
        if not new:
            return False
        pieces = self._pieces  # TextPieces.add, inline: once a token
        pieces.append(new)
        pieces.ends.append(pieces.ends[-1] + len(new))
        if check_stop and self.stop:
            tail = self._tail(len(new) + self._longest_stop - 1)  # every match that ends in `new` lies inside
            for s in self.stop:
                at = tail.find(s, max(0, len(tail) - len(new) - len(s) + 1))
                if at != -1:
                    self._cut(self._pieces.ends[-1] - len(tail) + at)
                    return True
        return False

    def _tail(self, chars: int) -> str:
        """The last pieces that hold at least `chars` characters (all of them if fewer), joined."""
        parts, total = [], 0
        for piece in reversed(self._pieces):
            parts.append(piece)
            total += len(piece)
            if total >= chars:
                break
        return "".join(reversed(parts))

    def _cut(self, at: int) -> None:
        """Keep the first `at` characters, in new pieces."""
        kept = TextPieces()
        for piece, start in zip(self._pieces, self._pieces.ends):
            kept.add(piece[:at - start])
            if start + len(piece) >= at:
                break
        self._pieces = kept

    def _window(self, token_id: int) -> str | None:
        """The new text once `token_id` is appended (None: nothing complete yet)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
