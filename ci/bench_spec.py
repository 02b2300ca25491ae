"""Speculative vs plain decoding speed with the oracle drafter at forced acceptance lengths.

The oracle proposes the target's own greedy continuation (from a plain run of the same engine),
corrupted from position m on, so every verify step accepts m drafts: this traces the engine's
best-case speedup curve (m = k) and its overhead when nothing is accepted (m = 0), independent
of any draft model's quality. In bf16 a verify step and a decode step round differently, so the
measured acceptance can fall slightly below m; the table reports the measured mean acceptance
length next to each speed.

    python ci/bench_spec.py [--hidden 2048 --layers 16 ...]   (results: $OUT/bench_spec.{json,md})
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def random_llama(path: str, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def timed_generate(engine, prompts, params) -> tuple[float, list[list[int]]]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, [o.token_ids for o in outs]


def run(model: str, batch_sizes: list[int], k: int, max_tokens: int, prompt_len: int, enforce_eager: bool) -> list[dict]:
    from atom_like import LLMEngine, SamplingParams
    from spec_decode.testing import OracleProposer, accept_first

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    common = dict(max_model_len=prompt_len + max_tokens + 2 * k + 16, max_num_seqs=max(batch_sizes),
                  gpu_memory_utilization=0.5, enforce_eager=enforce_eager)
    rows = []
    plain = LLMEngine(model, **common)
    for bs in batch_sizes:
        g = torch.Generator().manual_seed(bs)
        prompts = [torch.randint(0, plain.runner.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(bs)]
        timed_generate(plain, prompts[:1], params)  # warm-up
        base_tps, continuations = timed_generate(plain, prompts, params)
        rows.append(dict(batch=bs, mode="plain", forced=None, tokens_per_s=base_tps, mean_acceptance_length=1.0))
        for m in range(k + 1):
            conts = {str(i): c for i, c in enumerate(continuations)}
            engine = LLMEngine(model, proposer_factory=lambda r: OracleProposer(conts, k, r.vocab_size, accept_first(m)),
                               **common)
            ids = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            generated = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        generated += len(out.token_ids)
            torch.cuda.synchronize()
            tps = generated / (time.perf_counter() - start)
            rows.append(dict(batch=bs, mode=f"spec k={k}", forced=m, tokens_per_s=tps,
                             mean_acceptance_length=engine.spec_stats.mean_acceptance_length,
                             speedup=tps / base_tps))
            del engine
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| batch | mode | forced accepted | measured AL | tokens/s | vs plain |", "|---|---|---|---|---|---|"]
    for r in rows:
        forced = "-" if r["forced"] is None else r["forced"]
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "1.00x"
        lines.append(f"| {r['batch']} | {r['mode']} | {forced} | {r['mean_acceptance_length']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {speed} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--graphs", choices=["off", "on", "both"], default="both")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    model = random_llama(tempfile.mkdtemp(), args.hidden, args.layers, args.vocab, args.heads, args.kv_heads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results, text = {}, []
    modes = {"off": [True], "on": [False], "both": [True, False]}[args.graphs]
    for eager in modes:
        name = "eager" if eager else "graphs"
        results[name] = run(model, batches, args.k, args.max_tokens, args.prompt_len, eager)
        text.append(markdown(results[name], f"{name}: Llama {args.hidden}x{args.layers}, bf16, {torch.cuda.get_device_name()}"))
    with open(os.path.join(out_dir, "bench_spec.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "bench_spec.md"), "w") as f:
        f.write("\n\n".join(text) + "\n")
    print("\n\n".join(text))


if __name__ == "__main__":
    main()
