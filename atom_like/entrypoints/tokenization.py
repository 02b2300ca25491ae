"""Tokenization for the server, off the event loop.

Tokenizing a multi-megabyte prompt takes seconds, and rendering a chat template is Python:
done on the event loop, either would stall /health and every stream. So the server does both
in a few worker threads, each with its own copy of the tokenizer (an HF fast tokenizer carries
mutable settings, e.g. whether special tokens are parsed, and must not be shared between threads).

Chat messages: only the template's own markers are special tokens. A user who types
`<|im_end|>` in a message gets those characters as text, not a forged end of turn.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from jinja2 import TemplateError

T = TypeVar("T")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or cannot keep a special
    token typed in a message as text)."""


class TokenizerPool:
    def __init__(self, tokenizer, workers: int = 2):
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tokenizer")

    @property
    def tokenizer(self):
        """This worker thread's own copy of the tokenizer."""
        if not hasattr(self._local, "tokenizer"):
            self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return self._local.tokenizer

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(tokenizer, *args)` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(self._call, fn, *args))

    def _call(self, fn: Callable[..., T], *args) -> T:
        return fn(self.tokenizer, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def special_strings(tokenizer) -> list[str]:
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of `messages` under the tokenizer's chat template, with a generation prompt.
    Raises ChatTemplateError."""
    text = _render(tokenizer, messages)
    specials = special_strings(tokenizer)
    if not any(s in m["content"] for m in messages for s in specials):
        # The template already wrote any BOS it wants; tokenizing with special tokens would double it.
        return tokenizer(text, add_special_tokens=False).input_ids
    # Some content spells a special token. Render with a placeholder per content, then tokenize
    # the template's text with special tokens parsed and each content as plain text.
    marks = [f"\ue000atom-like-{i}\ue001" for i in range(len(messages))]
    marked = _render(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)])
    pieces, rest = [], marked
    for mark, message in zip(marks, messages):
        before, found, rest = rest.partition(mark)
        if not found or mark in rest:
            raise ChatTemplateError("a message contains a special token of this model "
                                    f"({', '.join(s for s in specials if s in message['content']) or 'see the others'}) "
                                    "and this chat template does not place message content verbatim, so it cannot "
                                    "be kept as plain text: remove it from the message")
        pieces += [(before, False), (message["content"], True)]
    pieces.append((rest, False))
    if "".join(p for p, _ in pieces) != text:  # the template transforms content (e.g. trims it)
        raise ChatTemplateError("a message contains a special token of this model and this chat template rewrites "
                                "message content, so it cannot be kept as plain text: remove it from the message")
    ids: list[int] = []
    for piece, is_content in pieces:
        if piece:
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=is_content).input_ids
    return ids


def _render(tokenizer, messages: list[dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
