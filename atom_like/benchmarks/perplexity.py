"""Held-out perplexity through the engine's own model and paged KV cache, so that MXFP4 weights,
MXFP4 activations and an fp8 KV cache all count: for comparing a model with its quantized form.

    python -m atom_like.benchmarks.perplexity --model tiny-kimi-mxfp4 [--kv-cache-dtype fp8]
        [--datasets sharegpt,gsm8k] [--num-texts 64] [--max-len 512] [--batch 8] [engine flags]

Texts: held-out ShareGPT conversations (whole chats through the chat template; the split the zoo
never trains on) and GSM8K *test* questions with their worked answers, each cut to --max-len
tokens. Each text is a prompt-only request for its prompt logprobs (max_tokens 0): the engine
prefills it as it serves (every layer writes its KV into the paged cache and attends over what it
reads back) and scores every position from that forward, so any engine flag applies, -tp N
included. Perplexity = exp(mean next-token NLL) over every predicted token of a set.
"""
from __future__ import annotations

import argparse
import json
import logging
import math

from atom_like import EngineArgs, LLMEngine, SamplingParams
from atom_like.config import add_flag
from atom_like.zoo import model_path

DATASETS = ("sharegpt", "gsm8k")


def heldout_texts(dataset: str, n: int) -> list[list[dict]]:
    from atom_like.zoo import data

    if dataset == "sharegpt":
        return [chat for _, chat in data.load_sharegpt("heldout")[:n]]
    if dataset == "gsm8k":
        return [data.gsm8k_chat(r["question"], r["answer"]) for r in data.read_jsonl(data.gsm8k_test_path())[:n]]
    raise ValueError(f"--datasets: unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


def nll(engine: LLMEngine, texts: list[list[int]], batch: int) -> tuple[float, int]:
    """(sum of next-token NLL, number of predicted tokens) over `texts`, `batch` texts at a time."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    total, count = 0.0, 0
    for i in range(0, len(texts), batch):
        for out in engine.generate(texts[i:i + batch], params, use_tqdm=False):
            scored = out.prompt_logprobs[1:]  # nothing predicts the first token
            total -= sum(lp.logprob for lp in scored)
            count += len(scored)
    return total, count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="tiny-kimi", enforce_eager=True)
    add_flag(parser, "datasets", str, ",".join(DATASETS), "Text sets: sharegpt, gsm8k.")
    add_flag(parser, "num_texts", int, 64, "Texts per set.")
    add_flag(parser, "max_len", int, 512, "Tokens per text (longer texts are cut).")
    add_flag(parser, "batch", int, 8, "Texts in flight at a time.")
    add_flag(parser, "output", str, None, "Write the report as JSON here.")
    cli = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cli.model = model_path(cli.model)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(cli))
    tok = engine.tokenizer
    report = {}
    for dataset in cli.datasets.split(","):
        texts = [tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"][:cli.max_len]
                 for chat in heldout_texts(dataset, cli.num_texts)]
        total, count = nll(engine, texts, cli.batch)
        report[dataset] = dict(texts=len(texts), tokens=count, perplexity=math.exp(total / count))
        print(f"{dataset:<9} {len(texts):>4} texts {count:>7} tokens  perplexity {report[dataset]['perplexity']:.3f}")
    if cli.output:
        with open(cli.output, "w") as f:
            json.dump({"model": cli.model, "kv_cache_dtype": cli.kv_cache_dtype,
                       "mxfp4_activations": cli.mxfp4_activations, "report": report}, f, indent=1)


if __name__ == "__main__":
    main()
