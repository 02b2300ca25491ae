"""Batched greedy generation, and regenerating training data from the target's own answers.

Why regenerate: a draft is graded on the target's *own* greedy text, which differs from the
human/ChatGPT text of ShareGPT. Training the draft on the target's replies to training prompts
(never to eval prompts) is the cheapest large gain in acceptance (see
../shared/reference/eagle3_training_baseline.md). HF ``generate`` is slow one prompt at a time,
so prompts are sorted by length and run in large left-padded batches, under a time budget.
The new text is stored as token ids (prompt + reply, the reply masked as the assistant part),
never re-tokenized from a decoded string.

``python -m atom_like.zoo.regenerate --target DIR --prompts regen_prompts.jsonl --out DIR``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, stop_ids, pad_id: int,
                    batch_size: int = 64, deadline: float | None = None) -> list[list[int] | None]:
    """Greedy continuations of ``prompts`` (each cut after its first stop token).

    Runs length-sorted, left-padded batches; with ``deadline`` (a ``time.time()`` value) it stops
    starting new batches once the deadline has passed, and the prompts it skipped get ``None``.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    stop = list(stop_ids)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop or None,
                              pad_token_id=pad_id, use_cache=True)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int] | None] = [None] * len(prompts)
    for lo in range(0, len(order), batch_size):
        if deadline is not None and time.time() > deadline:
            break
        idx = order[lo: lo + batch_size]
        L = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), L), pad_id, dtype=torch.long)
        mask = torch.zeros(len(idx), L, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, L - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, L - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for row, i in enumerate(idx):
            new = out[row, L:].tolist()
            end = next((j + 1 for j, t in enumerate(new) if t in stop), len(new))
            results[i] = new[:end]
    return results


def regenerate(target, tok, chats: list, stop_ids, max_new_tokens: int, batch_size: int,
               max_prompt_tokens: int, deadline: float | None):
    """-> documents ``(prompt + reply ids, mask over the reply)`` for the prompts done in time."""
    from atom_like.zoo.shards import prompt_ids

    prompts = [p for p in (prompt_ids(tok, c) for c in chats) if len(p) <= max_prompt_tokens]
    replies = greedy_generate(target, prompts, max_new_tokens, stop_ids, tok.pad_token_id or 0, batch_size, deadline)
    return [(p + r, [False] * len(p) + [True] * len(r)) for p, r in zip(prompts, replies) if r]


def main(argv=None):
    from atom_like.zoo.data import read_jsonl
    from atom_like.zoo.shards import write_shards
    from atom_like.zoo.targets import load_target

    ap = argparse.ArgumentParser(prog="python -m atom_like.zoo.regenerate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target folder or zoo name")
    ap.add_argument("--prompts", required=True, help="regen_prompts.jsonl from build_data")
    ap.add_argument("--out", required=True, help="data folder to write the 'regen' shard set into")
    ap.add_argument("--name", default="regen")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--minutes", type=float, default=0, help="stop starting batches after this long")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    t0 = time.time()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target, tok, stop = load_target(args.target, dtype, args.device)
    chats = [r["messages"] for r in read_jsonl(Path(args.prompts))]
    chats = chats[: args.limit] if args.limit else chats
    docs = regenerate(target, tok, chats, stop, args.max_new_tokens, args.batch_size, args.max_prompt_tokens,
                      t0 + 60 * args.minutes if args.minutes else None)
    info = write_shards(docs, Path(args.out), args.name, tok, extra={"regenerated_by": str(args.target),
                        "max_new_tokens": args.max_new_tokens, "seconds": round(time.time() - t0, 1)})
    reply_tokens = sum(sum(m) for _, m in docs)
    print(f"regenerated {len(docs)} replies ({reply_tokens} tokens) in {time.time() - t0:.0f}s -> {args.out}: {info['shards']}")


if __name__ == "__main__":
    main()
