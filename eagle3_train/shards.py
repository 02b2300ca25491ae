"""Pre-tokenized training data: chats -> (token ids, assistant mask) -> compressed shards -> batches.

Why shards: the GPU machine has no network and each call carries at most 64 MiB, so training
text is tokenized here, on CPU, into ``.npz`` shards (uint16 ids, a bit-packed loss mask,
conversation offsets; zip-compressed) that are small enough to carry, and the trainers only
read them. ``dataset.json`` beside the shards records the tokenizer and counts, so a trainer can
refuse shards made with another tokenizer.

Batches are fixed-length windows cut from the concatenated token stream and reshuffled every
epoch (GPT-style packing): no padding, every token is used once per epoch. The mask marks the
tokens of assistant turns (their text and the turn's end token), for losses that should only
teach the model to answer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from atom_like.zoo.data import Chat

MANIFEST = "dataset.json"


def render(tok, chat: Chat, add_generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(tok, chat: Chat) -> list[int]:
    """Token ids of a prompt with the assistant header appended (what a chat request sends)."""
    return tok(render(tok, chat, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def encode_chat(tok, chat: Chat) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered chat and, per token, whether it belongs to an assistant turn.

    An assistant turn's span is the text between the prompt rendered up to it (with the
    generation header) and the chat rendered through it; that relies on renders of a chat's
    prefixes being prefixes of its render, which holds for ChatML and Kimi-style templates and is
    checked (a template that breaks it raises).
    """
    text = render(tok, chat)
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        head, through = render(tok, chat[:i], add_generation_prompt=True), render(tok, chat[: i + 1])
        if not (text.startswith(head) and text.startswith(through)):
            raise ValueError("chat template renders are not prefix-consistent; cannot locate assistant turns")
        spans.append((len(head), len(through)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return enc["input_ids"], mask.tolist()


def tokenizer_digest(tok) -> str:
    """A short fingerprint of a tokenizer's vocabulary and chat template."""
    h = hashlib.sha256(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update((tok.chat_template or "").encode())
    return h.hexdigest()[:16]


def write_shards(docs: Iterable[tuple[list[int], list[bool]]], out_dir: Path, prefix: str, tok,
                 tokens_per_shard: int = 8_000_000, extra: dict | None = None) -> dict:
    """Write ``(ids, mask)`` documents as ``<prefix>-NNNNN.npz`` shards; updates ``dataset.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if len(tok) > 65536:
        raise ValueError(f"vocab of {len(tok)} does not fit the uint16 shard format")
    for old in out_dir.glob(f"{prefix}-*.npz"):
        old.unlink()
    entries, ids_buf, mask_buf, starts = [], [], [], [0]

    def flush():
        if len(starts) == 1:
            return
        path = out_dir / f"{prefix}-{len(entries):05d}.npz"
        ids = np.concatenate(ids_buf).astype(np.uint16)
        mask = np.concatenate(mask_buf)
        np.savez_compressed(path, tokens=ids, mask=np.packbits(mask), starts=np.array(starts, dtype=np.int64))
        entries.append({"file": path.name, "tokens": int(len(ids)), "docs": len(starts) - 1,
                        "assistant_tokens": int(mask.sum()), "bytes": path.stat().st_size})
        ids_buf.clear(), mask_buf.clear()
        del starts[1:]

    for ids, mask in docs:
        ids_buf.append(np.asarray(ids, dtype=np.int64))
        mask_buf.append(np.asarray(mask, dtype=bool))
        starts.append(starts[-1] + len(ids))
        if starts[-1] >= tokens_per_shard:
            flush()
    flush()
    manifest_path = out_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest.update({"tokenizer": tokenizer_digest(tok), "vocab_size": len(tok)})
    manifest.setdefault("sets", {})[prefix] = {"shards": entries, **(extra or {})}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return manifest["sets"][prefix]


def read_set(data_dir: Path, prefix: str, tok=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate a set's shards: ``(tokens int64, mask bool, doc starts int64)``.

    With ``tok`` given, refuses shards that were made with a different tokenizer.
    """
    data_dir = Path(data_dir)
    manifest = json.loads((data_dir / MANIFEST).read_text())
    if tok is not None and manifest["tokenizer"] != tokenizer_digest(tok):
        raise ValueError(f"{data_dir} was tokenized with another tokenizer ({manifest['tokenizer']}) "
                         f"than the model's ({tokenizer_digest(tok)}); rebuild it with build_data")
    if prefix not in manifest.get("sets", {}):
        raise FileNotFoundError(f"no set {prefix!r} in {data_dir / MANIFEST}; sets: {list(manifest.get('sets', {}))}")
    toks, masks, starts, offset = [], [], [np.zeros(1, dtype=np.int64)], 0
    for entry in manifest["sets"][prefix]["shards"]:
        with np.load(data_dir / entry["file"]) as z:
            t = z["tokens"].astype(np.int64)
            toks.append(t)
            masks.append(np.unpackbits(z["mask"], count=len(t)).astype(bool))
            starts.append(z["starts"][1:] + offset)
            offset += len(t)
    return np.concatenate(toks), np.concatenate(masks), np.concatenate(starts)


class PackedWindows:
    """Fixed-length training windows over a token stream, reshuffled each epoch.

    Every epoch shifts the window grid by a random offset, so window boundaries do not always
    cut the text at the same places.
    """

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, seq_len: int, seed: int = 0):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"only {len(tokens)} tokens, fewer than one window of {seq_len}")
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.mask = torch.from_numpy(np.ascontiguousarray(mask, dtype=bool))
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)
        self.epoch = 0

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless ``(ids [B, L], mask [B, L])`` batches; ``self.epoch`` counts full passes."""
        L = self.seq_len
        while True:
            shift = int(self.rng.integers(0, L))
            n = (len(self.tokens) - shift) // L
            if n < batch_size:
                raise ValueError(f"{n} windows of {L} tokens cannot fill a batch of {batch_size}")
            order = self.rng.permutation(n)
            for i in range(0, n - batch_size + 1, batch_size):
                idx = shift + torch.from_numpy(order[i:i + batch_size]).unsqueeze(1) * L + torch.arange(L)
                yield self.tokens[idx], self.mask[idx]
            self.epoch += 1
