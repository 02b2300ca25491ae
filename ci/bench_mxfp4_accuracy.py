"""tiny-kimi-mxfp4 (Quark MXFP4, released style) against tiny-kimi (bf16): held-out perplexity and
EAGLE3 mean acceptance length at k = 3, each also with an fp8 KV cache, all through the engine.

    python ci/bench_mxfp4_accuracy.py [--num 64] [--max-tokens 128] [--drafts tiny-kimi-eagle3,...] [--chunk 16]
        [--styles experts_only]
        (results: $OUT/bench_mxfp4_accuracy.{json,md}; builds tiny-kimi-mxfp4 into the zoo cache first)

Perplexity: atom_like.benchmarks.perplexity (held-out ShareGPT chats, GSM8K test Q+A, 512 tokens
each), each text prefilled in one step: with an fp8 cache a prefill attends its own tokens
unquantized (as vLLM and SGLang do), so there the cache does not count. `--chunk N` adds the same
perplexity with every text prefilled N tokens a step (--max-num-batched-tokens N); at N <= 16
every chunk runs MLA's absorbed form, so every token attends all its context, its own row
included, through the cache: what decode sees. Acceptance: atom_like.benchmarks.acceptance (GSM8K
test questions and held-out ShareGPT first turns, greedy, --max-tokens new tokens). Rows:
tiny-kimi, tiny-kimi + fp8 KV (scale 1.0: its checkpoint has none), tiny-kimi-mxfp4 W4A4 (as the
checkpoint says), + fp8 KV (the checkpoint's calibrated scales), and W4A16 (--mxfp4-activations
unquantized). Each cell also gives the change against the first row; the goal is within 3%.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from atom_like import EngineArgs, LLMEngine
from atom_like.benchmarks import acceptance, perplexity
from atom_like.zoo import model_path, registry, tiny_kimi_mxfp4

CONFIGS = [  # (label, model, kv cache dtype, mxfp4 activations)
    ("tiny-kimi (bf16)", "tiny-kimi", "auto", "checkpoint"),
    ("tiny-kimi + fp8 KV", "tiny-kimi", "fp8", "checkpoint"),
    ("tiny-kimi-mxfp4 W4A4", "tiny-kimi-mxfp4", "auto", "checkpoint"),
    ("tiny-kimi-mxfp4 W4A4 + fp8 KV", "tiny-kimi-mxfp4", "fp8", "checkpoint"),
    ("tiny-kimi-mxfp4 W4A16", "tiny-kimi-mxfp4", "auto", "unquantized"),
]
SETS = ("sharegpt", "gsm8k")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=64, help="texts / prompts per set")
    ap.add_argument("--max-len", type=int, default=512, help="tokens per perplexity text")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per acceptance prompt")
    ap.add_argument("--drafts", default="tiny-kimi-eagle3,tiny-kimi-eagle3-mla,tiny-kimi-eagle3.1-mla")
    ap.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))), help="rows to run (indices)")
    ap.add_argument("--chunk", type=int, default=0, help="also perplexity with N-token prefill chunks (0: not)")
    ap.add_argument("--styles", default="", help="also tiny-kimi converted in these other Quark exclude styles "
                    "(experts_only: routed experts alone MXFP4), W4A4 and W4A16 rows each")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    cli = ap.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    if registry.locate("tiny-kimi-mxfp4") is None:
        registry.prepare("tiny-kimi-mxfp4")
    drafts = cli.drafts.split(",") if cli.drafts else []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = {s: acceptance.eval_prompts(s, cli.num) for s in SETS}
    configs = [CONFIGS[int(i)] for i in cli.configs.split(",")]
    for style in filter(None, cli.styles.split(",")):
        path = str(tiny_kimi_mxfp4.convert(Path(tempfile.mkdtemp()) / f"tiny-kimi-mxfp4-{style}", style=style))
        configs += [(f"tiny-kimi-mxfp4 {style} W4A4", path, "auto", "checkpoint"),
                    (f"tiny-kimi-mxfp4 {style} W4A16", path, "auto", "unquantized")]
    rows = []
    for label, model, kv, acts in configs:
        start = time.time()
        args = EngineArgs(model=model if os.path.isdir(model) else model_path(model), kv_cache_dtype=kv,
                          mxfp4_activations=acts, enforce_eager=True)
        row = {"config": label, "device": device}
        runs = [("", args)]
        if cli.chunk:
            runs.append((f"_chunk{cli.chunk}", dataclasses.replace(args, max_num_batched_tokens=cli.chunk)))
        for suffix, run_args in runs:
            engine = LLMEngine.from_engine_args(run_args)
            row["dtype"] = str(engine.dtype)
            tok = engine.tokenizer
            for s in SETS:
                texts = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"][:cli.max_len]
                         for c in perplexity.heldout_texts(s, cli.num)]
                total, count = perplexity.nll(engine, texts, batch=8)
                row[f"ppl_{s}{suffix}"] = math.exp(total / count)
            del engine
        for draft in drafts:
            spec_args = EngineArgs(model=args.model, kv_cache_dtype=kv, mxfp4_activations=acts,
                                   method="eagle3", draft_model=model_path(draft))
            for s, r in acceptance.measure(spec_args, prompts, 3, cli.max_tokens).items():
                row[f"acc_{draft}_{s}"] = r["mean_acceptance_length"]
        row["seconds"] = round(time.time() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    chunked = [f"ppl_{s}_chunk{cli.chunk}" for s in SETS] if cli.chunk else []
    keys = [f"ppl_{s}" for s in SETS] + chunked + [f"acc_{d}_{s}" for d in drafts for s in SETS]
    lines = [f"| config | {' | '.join(keys)} |", "|---" * (len(keys) + 1) + "|"]
    for row in rows:
        cells = [f"{row[k]:.3f} ({100 * (row[k] / base[k] - 1):+.1f}%)" if row is not base else f"{row[k]:.3f}"
                 for k in keys]
        lines.append(f"| {row['config']} | {' | '.join(cells)} |")
    header = (f"tiny-kimi-mxfp4 accuracy on {device} ({rows[0]['dtype']}), {cli.num} texts/prompts per set, "
              f"ppl over {cli.max_len}-token texts, acceptance k=3 with {cli.max_tokens} new tokens")
    md = header + "\n\n" + "\n".join(lines) + "\n"
    print(md)
    with open(os.path.join(cli.out, "bench_mxfp4_accuracy.md"), "w") as f:
        f.write(md)
    with open(os.path.join(cli.out, "bench_mxfp4_accuracy.json"), "w") as f:
        json.dump({"args": vars(cli), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
