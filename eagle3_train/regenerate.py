"""Batched greedy generation, and regenerating training data from the target's own answers.

Why regenerate: a draft is graded on the target's *own* greedy text, which differs from the
human/ChatGPT text of ShareGPT. Training the draft on the target's replies to training prompts
(never to eval prompts) is the cheapest large gain in acceptance (docs/zoo.md, "Training baseline"), so the more replies
per minute the better.
Two generators, both greedy and under a time budget: our own engine (``engine_generate``: paged
KV cache, continuous batching, CUDA graphs; the default on a GPU) and transformers' ``generate``
(``greedy_generate``: length-sorted, left-padded batches; the default on CPU and the oracle the
engine path is tested against). The new text is stored as token ids (prompt + reply, the reply
masked as the assistant part), never re-tokenized from a decoded string.

``python -m eagle3_train.regenerate --target DIR --prompts regen_prompts.jsonl --out DIR``
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


def engine_generate(target_dir, prompts: list[list[int]], max_new_tokens: int, stop_ids, batch_size: int = 256,
                    deadline: float | None = None, dtype: str = "auto", device: str = "auto") -> list[list[int] | None]:
    """``greedy_generate`` through atom_like's engine: same contract (cut after the first stop
    token, ``None`` for prompts skipped at the deadline). Prompts go in rounds of 8 batches so the
    deadline is checked between rounds; the KV cache is sized for one full batch only, which keeps
    the GPU free for whatever runs next in this process."""
    import gc

    from atom_like import EngineArgs, LLMEngine, SamplingParams

    block_size, longest = 16, max(map(len, prompts)) + max_new_tokens
    blocks = batch_size * -(-longest // block_size) + 64
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(target_dir), dtype=dtype, device=device, max_num_seqs=batch_size, max_model_len=longest + 1,
        block_size=block_size, num_kv_blocks=blocks))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids))
    results: list[list[int] | None] = [None] * len(prompts)
    chunk = 8 * batch_size
    try:
        for lo in range(0, len(prompts), chunk):
            if deadline is not None and time.time() > deadline:
                break
            for i, out in enumerate(engine.generate(prompts[lo: lo + chunk], params, use_tqdm=False), lo):
                results[i] = out.token_ids
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def load_for_regeneration(name_or_dir, use_engine: bool, device: str):
    """-> (the ``target`` that ``regenerate`` takes, tokenizer, stop ids): the checkpoint folder for
    our engine, else the transformers model loaded on ``device`` (bf16 on a GPU, fp32 on CPU)."""
    from transformers import AutoTokenizer

    from eagle3_train.targets import load_target, stop_token_ids, zoo_path

    if not use_engine:
        return load_target(name_or_dir, torch.bfloat16 if str(device).startswith("cuda") else torch.float32, device)
    path = zoo_path(name_or_dir)
    tok = AutoTokenizer.from_pretrained(str(path))
    return path, tok, stop_token_ids(path, tok)


def regenerate(target, tok, chats: list, stop_ids, max_new_tokens: int, batch_size: int,
               max_prompt_tokens: int, deadline: float | None):
    """-> documents ``(prompt + reply ids, mask over the reply)`` for the prompts done in time.

    ``target`` is a loaded transformers model (``greedy_generate``) or a checkpoint folder, which
    runs on atom_like's engine (``engine_generate``)."""
    from eagle3_train.shards import prompt_ids

    prompts = [p for p in (prompt_ids(tok, c) for c in chats) if len(p) <= max_prompt_tokens]
    if isinstance(target, (str, Path)):
        replies = engine_generate(target, prompts, max_new_tokens, stop_ids, batch_size, deadline)
    else:
        replies = greedy_generate(target, prompts, max_new_tokens, stop_ids, tok.pad_token_id or 0, batch_size,
                                  deadline)
    return [(p + r, [False] * len(p) + [True] * len(r)) for p, r in zip(prompts, replies) if r]


def main(argv=None):
    from atom_like.zoo.data import read_jsonl
    from eagle3_train.shards import write_shards

    ap = argparse.ArgumentParser(prog="python -m eagle3_train.regenerate", description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--generator", choices=["engine", "transformers"], default=None,
                    help="who generates (default: our engine on a GPU, transformers' generate on CPU)")
    args = ap.parse_args(argv)
    t0 = time.time()
    generator = args.generator or ("engine" if args.device.startswith("cuda") else "transformers")
    target, tok, stop = load_for_regeneration(args.target, generator == "engine", args.device)
    chats = [r["messages"] for r in read_jsonl(Path(args.prompts))]
    chats = chats[: args.limit] if args.limit else chats
    docs = regenerate(target, tok, chats, stop, args.max_new_tokens, args.batch_size, args.max_prompt_tokens,
                      t0 + 60 * args.minutes if args.minutes else None)
    info = write_shards(docs, Path(args.out), args.name, tok, extra={"regenerated_by": str(args.target), "generator": generator,
                        "max_new_tokens": args.max_new_tokens, "seconds": round(time.time() - t0, 1)})
    reply_tokens = sum(sum(m) for _, m in docs)
    print(f"regenerated {len(docs)} replies ({reply_tokens} tokens) in {time.time() - t0:.0f}s -> {args.out}: {info['shards']}")


if __name__ == "__main__":
    main()
