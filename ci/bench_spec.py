"""Speculative vs plain decoding speed at forced acceptance lengths.

A real EAGLE3 draft (random weights, the target's layer shapes) runs every step, eagerly or as a
captured graph, and verification accepts exactly m of its k drafts (spec_decode.testing.
ForcedAcceptance, like ATOM's --spec-decode-acceptance-length): this traces the engine's
speedup curve, best case m = k, and its overhead when nothing is accepted, m = 0, independent of
any draft's quality. (A precomputed greedy continuation as the oracle does not work here: on
random weights the logits are flat, and bf16 verify and decode steps round differently enough
to flip near-ties, after which the continuation no longer matches; measured, it fell to a mean
acceptance length of ~1.1 at batch 8 and 32.)

    python ci/bench_spec.py [--hidden 2048 --layers 16 ...]   (results: $OUT/bench_spec.{json,md})
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_llama(path: str, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def random_eagle3_draft(path: str, target: str) -> str:
    """A random-init EAGLE3 Llama draft shaped like the target's layers (bf16)."""
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(target, "config.json")))
    h, heads, kv, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    d, inter = h // heads, cfg["intermediate_size"]
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"fc.weight": w(h, 3 * h), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": w(vocab, h), "midlayer.self_attn.o_proj.weight": w(h, heads * d),
               "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
               "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h), "midlayer.mlp.gate_proj.weight": w(inter, h),
               "midlayer.mlp.up_proj.weight": w(inter, h), "midlayer.mlp.down_proj.weight": w(h, inter)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    n = cfg["num_hidden_layers"]
    json.dump({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
               "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
               "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab,
               "max_position_embeddings": cfg["max_position_embeddings"], "tie_word_embeddings": False,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3], "use_aux_hidden_state": True}},
              open(os.path.join(path, "config.json"), "w"))
    return path


def timed_steps(engine, prompts, params, tag: str) -> float:
    """Generated tokens per second for `prompts` run together to completion."""
    ids = [engine.add_request(p, params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    done = {}
    sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    sync()
    assert sorted(done) == sorted(ids)
    return sum(len(t) for t in done.values()) / (time.perf_counter() - start)


def run(model: str, batch_sizes: list[int], k: int, max_tokens: int, prompt_len: int, enforce_eager: bool,
        draft: str, capture_draft: bool = True) -> list[dict]:
    """One plain engine and one speculative engine whose forced acceptance changes between runs,
    so each mode builds (and captures graphs) only twice."""
    from atom_like import LLMEngine, SamplingParams
    from atom_like.engine.speculative import build_eagle3_proposer
    from spec_decode.testing import ForcedAcceptance

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    common = dict(max_model_len=prompt_len + max_tokens + 2 * k + 16, max_num_seqs=max(batch_sizes),
                  gpu_memory_utilization=0.35, enforce_eager=enforce_eager)
    plain = LLMEngine(model, **common)

    def factory(runner):
        args = dataclasses.replace(runner.args, method="eagle3", draft_model=draft, num_speculative_tokens=k)
        proposer = build_eagle3_proposer(args, runner.model, runner.dtype, runner.device, runner.kv_cache_dtype)
        proposer.capturable = capture_draft  # False: the target step is a graph, the draft loop runs eagerly
        return proposer

    spec = LLMEngine(model, proposer_factory=factory, speculative_adaptive=False, **common)  # graphs for k alone
    forced = spec.runner.sampler.verifier = ForcedAcceptance(0)
    rows = []
    for bs in batch_sizes:
        g = torch.Generator().manual_seed(bs)
        prompts = [torch.randint(0, plain.runner.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(bs)]
        # untimed warm-ups at the full batch: what the first run at a batch size does once (Triton
        # compiles its shapes on a cold cache: 0.54x the warm plain rate at batch 32 on an H100)
        # stays out of the timings
        warm = dataclasses.replace(params, max_tokens=8)
        timed_steps(plain, prompts, warm, f"warm{bs}")
        base_tps = timed_steps(plain, prompts, params, f"plain{bs}")
        rows.append(dict(batch=bs, mode="plain", forced=None, tokens_per_s=base_tps, mean_acceptance_length=1.0))
        timed_steps(spec, prompts, warm, f"warmspec{bs}")
        for m in range(k + 1):
            forced.m = m
            before = (spec.spec_stats.num_drafts, spec.spec_stats.num_accepted_tokens)
            tps = timed_steps(spec, prompts, params, f"spec{bs}m{m}")
            drafts = spec.spec_stats.num_drafts - before[0]
            accepted = spec.spec_stats.num_accepted_tokens - before[1]
            rows.append(dict(batch=bs, mode=f"EAGLE3 k={k}", forced=m, tokens_per_s=tps,
                             mean_acceptance_length=1 + accepted / max(drafts, 1), speedup=tps / base_tps))
    del plain, spec
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| batch | mode | forced accepted drafts | measured mean acceptance length | tokens/s | vs plain |", "|---|---|---|---|---|---|"]
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
    draft = random_eagle3_draft(tempfile.mkdtemp(), model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results, text = {}, []
    modes = {"off": ["eager"], "on": ["graphs"], "both": ["eager", "target graph, draft eager", "graphs"]}[args.graphs]
    for name in modes:
        results[name] = run(model, batches, args.k, args.max_tokens, args.prompt_len, name == "eager", draft,
                            capture_draft=name == "graphs")
        text.append(markdown(results[name], f"{name}: Llama {args.hidden}x{args.layers}, bf16, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"))
    with open(os.path.join(out_dir, "bench_spec.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "bench_spec.md"), "w") as f:
        f.write("\n\n".join(text) + "\n")
    print("\n\n".join(text))


if __name__ == "__main__":
    main()
