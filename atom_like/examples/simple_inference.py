"""Offline inference: `python -m atom_like.examples.simple_inference [--model DIR] [engine flags]`.

With no --model it runs the embedded default, the tiny-kimi target (Kimi-K2.5 architecture,
shipped in the package) with its EAGLE3 draft at k = 3. --model and --draft-model also take zoo
names (`python -m atom_like.zoo list`). Applies the tokenizer's chat template when it has one,
prints each prompt and completion, the throughput and, with a draft, the speculation stats.
`-tp N` runs it on N GPUs; under torchrun (`torchrun --nproc-per-node N -m
atom_like.examples.simple_inference ... -tp N`) rank 0 prints and the other ranks serve it.
"""
from __future__ import annotations

import argparse
import logging
import time

from atom_like import EngineArgs, LLMEngine, SamplingParams
from atom_like.cli import entry_point
from atom_like.config import add_flag
from atom_like.zoo import DEFAULT_DRAFT, DEFAULT_TARGET, model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Explain in one sentence what a KV cache is.",
]


@entry_point
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    add_flag(parser, "temperature", float, 0.0, "Sampling temperature (0 = greedy).")
    add_flag(parser, "max_tokens", int, 128, "Tokens to generate per prompt.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.model is None:  # the embedded default: tiny-kimi with its best EAGLE3 draft
        args.model = DEFAULT_TARGET
        if args.method is None and args.draft_model is None:
            args.method, args.draft_model = "eagle3", DEFAULT_DRAFT
    args.model = model_path(args.model)
    if args.draft_model is not None:
        args.draft_model = model_path(args.draft_model)

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; simple_inference needs one to turn text into tokens "
                         "(pass --tokenizer DIR)")
    if tokenizer.chat_template:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=False) for p in PROMPTS]
        encoded = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    else:
        prompts, encoded = PROMPTS, [tokenizer(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)

    start = time.perf_counter()
    outputs = engine.generate(encoded, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out.text!r}")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s")
    if engine.spec_stats.num_drafts:
        print(engine.spec_stats.summary())
    engine.shutdown()  # -tp N: stop the workers (torchrun: release the other ranks)


if __name__ == "__main__":
    main()
