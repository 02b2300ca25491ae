"""Decode throughput of atom_like vs transformers on the same GPU, for random-init bf16 models:
a ~2B DeepSeek-V3-shaped MoE (Kimi's MLA head dims, grouped sigmoid routing, a shared expert)
and a ~1.2B Llama (Llama-3.2-1B's shape).

Methodology (decode only; prefill is excluded from every number):
* One checkpoint per model, random weights saved in bf16, read by both engines. Prompts are
  `--prompt-len` random token ids (all the same length, so transformers needs no padding);
  greedy; end-of-sequence ignored (atom_like: ignore_eos; transformers: min_new_tokens =
  max_new_tokens and no eos id); each configuration runs once untimed as a warm-up.
* atom_like: the batch's requests are added and the engine is stepped until every request has
  its first token (the prefill, untimed); then the remaining max_tokens - 1 decode steps are
  timed between two cuda synchronizations. tokens/s = batch * (max_tokens - 1) / seconds.
* transformers: `generate` on the [batch, prompt_len] ids with a static KV cache
  (cache_implementation="static", fixed shapes) where the model accepts it, else its default
  dynamic cache; torch.compile off (the MoE routing is data-dependent; compile time would
  dominate). t(n) = median of 3 timed generate calls producing n tokens; the first token comes
  with the prefill, so tokens/s = batch * (max_tokens - 1) / (t(max_tokens) - t(1)).
* atom_like runs with CUDA graphs off and on (`--graphs`), where the engine has them; the
  backends it used (torch reference or kernels_rocm Triton kernels) are recorded. `--norm both`
  adds runs with the eager RMSNorm instead of the fused add + RMSNorm kernel, in the same process.

    python ci/bench_models.py [--models deepseek,llama --batch-sizes 1,32 --max-tokens 64]
    results: $OUT/bench_models.json and $OUT/bench_models.md (default folder ./bench_out)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch

PROMPT_SEED = 0


def deepseek_config():
    from transformers import DeepseekV3Config

    # 12 layers (1 dense + 11 MoE of 48 experts x 512, top-6 in 4 of 8 groups, 1 shared expert);
    # MLA with Kimi-K2's per-head dims: kv_lora_rank 512 + rope 64 = 576-wide latent rows
    return DeepseekV3Config(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=512, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=48, num_experts_per_tok=6, n_shared_experts=1,
        n_group=8, topk_group=4, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1},
    )


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


MODELS = {"deepseek": deepseek_config, "llama": llama_config}


def save_random_model(name: str, folder: str) -> tuple[str, int]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(MODELS[name]()).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    path = os.path.join(folder, name)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path, params


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(PROMPT_SEED + batch)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def engine_decode(engine, batch_prompts: list[list[int]], max_tokens: int) -> float:
    from atom_like import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in batch_prompts}
    started: set[str] = set()
    while started != ids:  # prefill (untimed) until every request holds its first token
        started |= {out.request_id for out in engine.step() if out.token_ids}
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return len(batch_prompts) * (max_tokens - 1) / (time.perf_counter() - start)


def decode_step_bytes(engine, batch: int, context: int, top_k: int) -> float:
    """The fewest bytes one decode step must read: every weight it uses once (the embedding
    table only for its `batch` rows unless it doubles as the LM head; of the routed experts,
    the expected number a batch touches under uniform top-k routing, E * (1 - (1 - k/E)^batch))
    plus each sequence's KV at `context` tokens."""
    from model_ops.moe import FusedExperts

    model = engine.runner.model
    embed = model.model.embed_tokens.weight
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, FusedExperts):
            e = module.num_experts
            nbytes *= (1 - (1 - top_k / e) ** batch)
        elif p is embed and p is not model.lm_head.weight:
            nbytes = batch * p.shape[1] * p.element_size()
        total += nbytes
    kv_per_token = engine.runner.block_bytes / engine.runner.block_size
    return total + batch * context * kv_per_token


def bench_engine(path: str, batches: list[int], prompt_len: int, max_tokens: int, eager: bool,
                 copy_gbps: float, fused_norm: bool = True) -> list[dict]:
    from atom_like import LLMEngine
    from model_ops import layernorm
    from model_ops.moe import FusedExperts

    dispatch = layernorm._kernels_for
    if not fused_norm:
        layernorm._kernels_for = lambda x: None

    engine = LLMEngine(path, dtype="bfloat16", max_model_len=prompt_len + max_tokens + 16, max_num_seqs=max(batches),
                       gpu_memory_utilization=0.4, enforce_eager=eager)
    model = engine.runner.model
    backends = sorted({type(layer.backend).__name__ for layer in model.attention_layers()})
    experts = sorted({f"{m.impl.__module__}.{m.impl.__name__}" for m in model.modules() if isinstance(m, FusedExperts)})
    rows = []
    for batch in batches:
        batch_prompts = prompts(batch, prompt_len, engine.runner.vocab_size)
        engine_decode(engine, batch_prompts, max_tokens)  # warm-up
        tps = engine_decode(engine, batch_prompts, max_tokens)
        top_k = getattr(model.config, "num_experts_per_tok", 0) or 0
        roofline_ms = decode_step_bytes(engine, batch, prompt_len + max_tokens // 2, top_k) / copy_gbps / 1e6
        mode = ("eager" if eager else "graphs") + ("" if fused_norm else ", eager RMSNorm")
        rows.append(dict(engine="atom_like", mode=mode, batch=batch, tokens_per_s=tps,
                         step_ms=1e3 * batch / tps, roofline_ms=roofline_ms, attention_backends=backends,
                         experts_impl=experts))
    del engine, model
    layernorm._kernels_for = dispatch
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def bench_transformers(path: str, batches: list[int], prompt_len: int, max_tokens: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    cache = "static"
    rows = []
    for batch in batches:
        ids = torch.tensor(prompts(batch, prompt_len, model.config.vocab_size), device="cuda")

        def timed(n: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, cache_implementation=cache, disable_compile=True)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        try:
            timed(max_tokens)  # warm-up (and the static-cache probe)
        except Exception as err:  # noqa: BLE001 - any failure of the static path falls back to the default cache
            print(f"transformers static cache failed ({type(err).__name__}: {err}); using the dynamic cache")
            cache = None
            timed(max_tokens)
        first = statistics.median(timed(1) for _ in range(3))
        full = statistics.median(timed(max_tokens) for _ in range(3))
        rows.append(dict(engine="transformers", mode=f"generate, {cache or 'dynamic'} cache", batch=batch,
                         tokens_per_s=batch * (max_tokens - 1) / (full - first),
                         experts_impl=getattr(model.config, "_experts_implementation", None),
                         attn_impl=model.config._attn_implementation))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def markdown(results: dict, device: str, args) -> str:
    lines = [f"Decode tokens/s, bf16, {device}; prompt {args.prompt_len} tokens, {args.max_tokens} generated "
             f"(decode steps only). Roofline: the bytes a step must read (weights it uses, expected experts "
             f"touched, KV) / the copy bandwidth measured in this run ({results['copy_gbps']:.0f} GB/s).", ""]
    for name, res in results["models"].items():
        lines += [f"### {name}: {res['params'] / 1e9:.2f}B parameters", "",
                  "| engine | mode | batch | tokens/s | vs transformers | step ms | roofline ms | roofline / step |",
                  "|---|---|---|---|---|---|---|---|"]
        base = {r["batch"]: r["tokens_per_s"] for r in res["rows"] if r["engine"] == "transformers"}
        for r in res["rows"]:
            ratio = f"{r['tokens_per_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
            roof = (f"{r['step_ms']:.2f} | {r['roofline_ms']:.3f} | {r['roofline_ms'] / r['step_ms']:.0%}"
                    if "roofline_ms" in r else "- | - | -")
            lines.append(f"| {r['engine']} | {r['mode']} | {r['batch']} | {r['tokens_per_s']:.1f} | {ratio} | {roof} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="deepseek,llama")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--hf-batch-sizes", default="1,32", help="transformers is slow: fewer batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--graphs", choices=["off", "on", "both"], default="both")
    parser.add_argument("--norm", choices=["fused", "eager", "both"], default="fused",
                        help="RMSNorm on the GPU: the fused Triton kernel, the eager ops, or both side by side")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = {"off": [True], "on": [False], "both": [True, False]}[args.graphs]
    device = torch.cuda.get_device_name()
    from gpu_timing import measure_copy_bandwidth

    results = {"copy_gbps": measure_copy_bandwidth()["gbps"], "models": {}}
    hf_batches = [int(b) for b in args.hf_batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            path, params = save_random_model(name, folder)
            rows = []
            norms = {"fused": [True], "eager": [False], "both": [True, False]}[args.norm]
            for eager in modes:
                for fused_norm in norms:
                    rows += bench_engine(path, batches, args.prompt_len, args.max_tokens, eager, results["copy_gbps"],
                                         fused_norm)
            if not args.no_transformers:
                rows += bench_transformers(path, hf_batches, args.prompt_len, args.max_tokens)
            results["models"][name] = dict(params=params, config=MODELS[name]().to_dict(), rows=rows)
    import transformers

    meta = dict(device=device, torch=torch.__version__, transformers=transformers.__version__, args=vars(args))
    with open(os.path.join(out_dir, "bench_models.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1, default=str)
    text = markdown(results, device, args)
    with open(os.path.join(out_dir, "bench_models.md"), "w") as f:
        f.write(text)
    print(text)
    print(json.dumps({name: res["rows"] for name, res in results["models"].items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
