"""Kimi-K2.5-MXFP4 + its EAGLE3 draft at their released size, as ONE rank of TP8, on one GPU (issue 21).

What runs is the engine itself (LLMEngine, CUDA graphs, the scheduler), built from config.json
alone (`--load-format dummy`: every weight seeded random, no checkpoint file) as tensor-parallel
rank r of N without its peers (model_ops.tp, `simulated`: every shape, kernel and byte read is
that rank's; all-reduces return the rank's partial sum and all-gathers its part N times, moving
nothing). The collectives' time is therefore NOT in the measured times: it is estimated on paper
from the bytes each one moves (column "collectives on paper"), never added to them.

Model (config.json written to a temp folder): Kimi-K2.5's text model as released, 61 layers,
hidden 7168, MLA (64 heads, q_lora 1536, kv_lora 512 + rope 64, v_head 128, bf16), 384 routed
experts top-8 in one group + 1 shared expert (moe_intermediate 2048) and a dense layer 0
(intermediate 18432), all MLPs Quark MXFP4 W4A4 with AMD's released exclude list, vocab 163840,
YaRN x64 over 4096; fp8 (e4m3) KV cache with scales 1.0. Draft: lightseekorg/kimi-k2.5-eagle3's
shape (one Llama layer, hidden 7168, 64 heads of 128, intermediate 12288, aux layers (2, 30, 58),
own embeddings and lm_head), bf16, fp8 KV. At N = 8 a rank holds 8 heads, 256 of each expert's
2048 intermediate rows, 1/8 of the vocabulary.

Measured in one process: copy bandwidth (device-to-device copy, bytes read + written), then for
speculation off and EAGLE3 k = 3, 4 (one engine each, built in turn) and each concurrency B:
  * B requests with distinct random `--input-len` prompts (1k): prefill time (the first token of
    every request; one untimed prefill chunk first compiled its shapes), then `--warmup` decode
    steps, then a window of `--window` decode steps timed;
  * the same prompts extended so that the second window ends at input + output length (2k): the
    prefix cache serves the first 1k tokens, and the window measures the step at the end of the run.
A decode step's time is linear in the context (only the KV read grows), so the mean step of a
1k-in / 1k-out run is the mean of the two windows (both are reported). tokens/s per user =
tokens a request gained over the windows / their time (decode only: 1 / TPOT); total = B x that.
Speculation: every step accepts exactly m of the k drafts (spec_decode.testing.ForcedAcceptance
verifies while the real EAGLE3 proposer drafts, so the draft runs at full cost); m follows a fixed sequence whose
every 25 consecutive steps average the reference acceptance length exactly (k = 3: 2.88 = 22
steps of m = 2 and 3 of m = 1; k = 4: 3.24 = 19 of m = 2 and 6 of m = 3, spread evenly), so a
window of 25 steps reproduces it; the measured value is reported.

Roofline of a step = bytes this rank must read / the measured copy bandwidth: every weight once
(routed experts only those hit: with random routing, E (1 - (1 - top_k/E)^T) distinct experts for T
tokens; the shared expert always, also when fused into the routed experts' tensors), the KV of every sequence at the window's mean context, and with speculation the draft's
weights once per draft pass (k passes a step) and its KV. Random routing touches more experts than
real routing does, so the roofline and the measured time are both pessimistic alike.

    OUT=dir python ci/bench_kimi.py                 # full: H200 (141 GB), < 600 s
    OUT=dir python ci/bench_kimi.py --small         # 4 layers, B 1 and 4, short windows: a quick check
    python ci/bench_kimi.py --tiny --device cpu     # tiny dims on the CPU: checks the script only
Results: $OUT/bench_kimi.json (written after every measurement), bench_kimi.md, bench_kimi.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from bench_kimi_report import write_report  # noqa: E402
from model_ops import tp  # noqa: E402

# InferenceX reference acceptance lengths, Kimi-K2.5 EAGLE3, SPEED-Bench coding, thinking on
REFERENCE_ACCEPTANCE = {3: Fraction("2.88"), 4: Fraction("3.24")}
# Interconnects for the collectives on paper: peak unidirectional bandwidth per GPU (spec sheets,
# not measured here). H200 SXM: NVLink 4, 900 GB/s bidirectional. MI355X: 7 xGMI (Infinity
# Fabric) links, 1075 GB/s bidirectional in all.
BUS_GBPS = {"H200 NVLink": 450.0, "MI355X xGMI": 537.6}


@dataclass(frozen=True)
class KimiDims:
    """Kimi-K2.5's released dimensions (text model, and the kimi-k2.5-eagle3 draft)."""
    layers: int = 61
    hidden: int = 7168
    heads: int = 64
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128
    experts: int = 384
    top_k: int = 8
    moe_intermediate: int = 2048
    dense_intermediate: int = 18432
    vocab: int = 163840
    draft_heads: int = 64
    draft_head_dim: int = 128
    draft_intermediate: int = 12288
    max_position: int = 262144

    @property
    def aux_layer_ids(self) -> list[int]:
        """(2, 30, 58) at 61 layers (kimi-k2.5-eagle3's, input-of-layer convention)."""
        n = self.layers
        return [2, n // 2, n - 3] if n >= 6 else [n] * 3


# The same model at tiny width (every split still on MXFP4 block boundaries at N = 4 and 8): the
# CPU test and `--tiny`.
TINY = KimiDims(layers=3, hidden=128, heads=8, q_lora=64, kv_lora=32, rope=16, nope=32, v_head=32, experts=8,
                top_k=2, moe_intermediate=256, dense_intermediate=512, vocab=1024, draft_heads=8, draft_head_dim=16,
                draft_intermediate=256, max_position=4096)


def target_config(d: KimiDims) -> dict:
    """Kimi-K2.5-MXFP4's config.json at dims `d` (the vision tower is never built: a stub)."""
    from atom_like.zoo.quark_mxfp4 import EXCLUDES, quantization_config

    bos, eos = (163584, 163585) if d.vocab > 163585 else (1, 2)
    text = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": d.vocab,
        "hidden_size": d.hidden, "intermediate_size": d.dense_intermediate, "moe_intermediate_size": d.moe_intermediate,
        "num_hidden_layers": d.layers, "num_attention_heads": d.heads, "num_key_value_heads": d.heads,
        "q_lora_rank": d.q_lora, "kv_lora_rank": d.kv_lora, "qk_nope_head_dim": d.nope, "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v_head, "n_routed_experts": d.experts, "num_experts_per_tok": d.top_k, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "routed_scaling_factor": 2.827, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "num_nextn_predict_layers": 0, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": d.max_position, "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": 0,
    }
    vision = {"patch_size": 14, "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
              "intermediate_size": 128, "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 1,
              "merge_kernel_size": [2, 2]}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "vision_config": vision, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": 0,
            "tie_word_embeddings": False, "dtype": "bfloat16",
            "quantization_config": quantization_config(EXCLUDES["released"], activations=True)}


def draft_config(d: KimiDims) -> dict:
    """lightseekorg/kimi-k2.5-eagle3's config.json shape at dims `d`."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d.hidden,
            "intermediate_size": d.draft_intermediate, "num_attention_heads": d.draft_heads,
            "num_key_value_heads": d.draft_heads, "head_dim": d.draft_head_dim, "num_hidden_layers": 1,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 64.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0},
            "max_position_embeddings": d.max_position, "vocab_size": d.vocab, "draft_vocab_size": d.vocab,
            "target_hidden_size": d.hidden, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": d.aux_layer_ids, "use_aux_hidden_state": True}}


def write_configs(folder: str | Path, d: KimiDims) -> tuple[str, str]:
    """(target folder, draft folder), each holding config.json only."""
    paths = []
    for name, config in (("kimi-k2.5-mxfp4", target_config(d)), ("kimi-k2.5-eagle3", draft_config(d))):
        path = Path(folder) / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        paths.append(str(path))
    return paths[0], paths[1]


def build_engine(target: str, draft: str | None, k: int, **engine_args):
    """An LLMEngine on `target` (under whatever model_ops.tp state the caller set); with `draft`,
    EAGLE3 k verified by ForcedAcceptance. Returns (engine, the ForcedAcceptance or None)."""
    from atom_like import LLMEngine
    from spec_decode.testing import ForcedAcceptance

    if draft is None:
        return LLMEngine(target, **engine_args), None
    engine = LLMEngine(target, method="eagle3", draft_model=draft, num_speculative_tokens=k, speculative_adaptive=False,
                       **engine_args)  # k every step: the speed of k itself
    forced = engine.runner.sampler.verifier = ForcedAcceptance(k)
    return engine, forced


def acceptance_schedule(length: Fraction, k: int):
    """Accepted drafts m_i per step, 0 <= m_i <= k, whose every run of `denominator` consecutive
    steps averages `length` - 1 exactly: m_i = floor((i + 1) a) - floor(i a), a = length - 1."""
    a = length - 1
    if not 0 <= a <= k:
        raise ValueError(f"acceptance length {length} is outside [1, {k + 1}] for k = {k}")
    i = 0
    while True:
        yield math.floor((i + 1) * a) - math.floor(i * a)
        i += 1


# ----------------------------------------------------------------------------- bytes on paper

def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts T tokens route to, each choosing top_k distinct experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def rank_weights(runner) -> dict:
    """Bytes of this rank's weights by what a step reads of them."""
    from atom_like.models.deepseek_v2 import DeepseekV2MoE
    from model_ops.moe import FusedExperts
    from model_ops.quant.mxfp4_layers import MXFP4Experts

    def total(modules) -> int:
        params = {id(p): p for m in modules for p in m.parameters()}
        return sum(p.numel() * p.element_size() for p in params.values())

    model = runner.model
    routed = [m for m in model.modules() if isinstance(m, (MXFP4Experts, FusedExperts))]
    embed = [m for name, m in model.named_modules() if name.endswith("embed_tokens")]
    # a shared expert fused into the routed experts (their last slot) is read every step like a dense layer
    fused_shared = sum(total([m.experts]) // m.experts.num_experts for m in model.modules()
                       if isinstance(m, DeepseekV2MoE) and m.shared_slot is not None)
    out = dict(all=total([model]), routed=total(routed) - fused_shared, embed=total(embed), moe_layers=len(routed))
    out["dense"] = out["all"] - out["routed"] - out["embed"]  # read whole every step
    if runner.proposer is not None:
        draft = runner.proposer.draft
        fc = total([draft.fc])
        d_embed = total([m for name, m in draft.named_modules() if name.endswith("embed_tokens")])
        out.update(draft_all=total([draft]), draft_fc=fc, draft_embed=d_embed,
                   draft_pass=total([draft]) - fc - d_embed)  # the layer, norms, lm_head: every draft pass
    return out


def kv_bytes_per_token(runner) -> tuple[float, float]:
    """(target, draft) KV bytes one token occupies on this rank (all layers, scales included)."""
    per_block = [b.compute_block_bytes() / runner.block_size for b in runner.builders]
    return per_block[0], sum(per_block[1:])


def step_bytes(weights: dict, kv: tuple[float, float], experts: int, top_k: int, batch: int, k: int,
               context: float) -> float:
    """Bytes one decode step reads on this rank: B sequences at mean context `context`, k drafts
    (k = 0: no speculation). A verify step runs B (k + 1) target tokens; the draft then runs k
    passes (the first over those B (k + 1) rows, reading fc), each reading the draft's layer and
    lm_head and its KV."""
    tokens = batch * (k + 1)
    hit = expected_experts_hit(experts, top_k, tokens) / experts
    target = weights["dense"] + weights["routed"] * hit + kv[0] * batch * context
    if k == 0:
        return target
    return target + weights["draft_fc"] + k * (weights["draft_pass"] + kv[1] * batch * context)


def collectives_per_step(d: KimiDims, batch: int, k: int, size: int) -> dict:
    """All-reduces and all-gathers one decode step runs on each rank, and the bytes they move
    (bf16 activations): the target's embedding + 2 per layer (attention, MLP) over its tokens and
    its logits' all-gather; with a draft, per pass its embedding, attention and MLP all-reduces and
    an all-gather of B rows of logits. Ring time = bytes x 2(N-1)/N (all-reduce) or (N-1)/N
    (all-gather) / bus bandwidth."""
    tokens = batch * (k + 1)
    act = d.hidden * 2
    reduces = [(1 + 2 * d.layers, tokens * act)]
    gathers = [(1, tokens * d.vocab * 2)]
    if k:
        reduces += [(3, tokens * act), (3 * (k - 1), batch * act)]  # first pass over the verified rows, then chain
        gathers += [(k, batch * d.vocab * 2)]
    wire = (sum(n * b for n, b in reduces) * 2 * (size - 1) / size
            + sum(n * b for n, b in gathers) * (size - 1) / size)
    return dict(all_reduces=sum(n for n, _ in reduces), all_gathers=sum(n for n, _ in gathers),
                all_reduce_bytes=sum(n * b for n, b in reduces), all_gather_bytes=sum(n * b for n, b in gathers),
                ring_bytes=wire, ms={name: wire / (gbps * 1e9) * 1e3 for name, gbps in BUS_GBPS.items()})


# ----------------------------------------------------------------------------- measuring

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, num_bytes: int) -> dict:
    """Device-to-device copy of `num_bytes`, median of 10; GB/s counts bytes read + written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    del src, dst
    seconds = sorted(times)[len(times) // 2]
    return dict(bytes=2 * num_bytes, ms=seconds * 1e3, gbps=2 * num_bytes / seconds / 1e9)


def run_window(engine, forced, prompts: list[list[int]], warmup: int, window: int, schedule, tag: str,
               profile_steps: int = 0) -> dict:
    """Admit `prompts`, run until each has its first token (prefill), then `warmup` + `window`
    decode steps, timing the window; abort the requests. Returns the window's numbers, with
    `profile_steps` more steps under a device-only torch.profiler after the window (not timed):
    kernels a step, GPU idle, the kernels that take the time."""
    from atom_like import SamplingParams

    # as many tokens as the context allows: sequences admitted in the first prefill steps decode
    # while the others prefill, and a tighter max_tokens finished some inside the window (that is
    # what made speculation-off gain 0.86-0.90 tokens per user-step at B = 64 in the first H200 run)
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - max(map(len, prompts)), ignore_eos=True)
    hits_before = engine.block_manager.num_hit_tokens
    ids = [engine.add_request(p, params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    count = dict.fromkeys(ids, 0)

    def step() -> None:
        if forced is not None:
            forced.m = next(schedule)
        for out in engine.step():
            count[out.request_id] = len(out.token_ids)

    sync()
    start = time.perf_counter()
    while min(count.values()) == 0:
        step()
    sync()
    prefill_s = time.perf_counter() - start
    for _ in range(warmup):
        step()
    before = dict(count)
    stats = (engine.spec_stats.num_drafts, engine.spec_stats.num_accepted_tokens)
    sync()
    start = time.perf_counter()
    for _ in range(window):
        step()
    sync()
    seconds = time.perf_counter() - start
    gained = [count[i] - before[i] for i in ids]
    drafts = engine.spec_stats.num_drafts - stats[0]
    accepted = engine.spec_stats.num_accepted_tokens - stats[1]
    profile = kernel_profile(step, profile_steps) if profile_steps and torch.cuda.is_available() else None
    for i in ids:
        engine.abort_request(i)
    while engine.has_unfinished_requests():
        engine.step()
    per_user = sum(gained) / len(ids)
    return dict(prompt_len=len(prompts[0]), prefill_s=prefill_s,
                prefill_tokens=sum(map(len, prompts)) - (engine.block_manager.num_hit_tokens - hits_before),
                context=len(prompts[0]) + (before[ids[0]] + count[ids[0]]) / 2, step_ms=seconds / window * 1e3,
                tokens_per_user=per_user, tokens_per_step=per_user / window,
                acceptance_length=1 + accepted / drafts if drafts else None, profile=profile)


def kernel_profile(step, steps: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from profile_tables import kernel_table, profile_calls

    prof, wall = profile_calls(step, steps, [ProfilerActivity.CUDA], sync)
    table = kernel_table([e for e in prof.events() if e.device_type != DeviceType.CPU], steps, top=30)
    return dict(steps=steps, wall_ms_per_step=1e3 * wall / steps, **table)


def warm_up_prefill(engine, args, rng: torch.Generator) -> None:
    """One full prefill chunk (`--max-num-batched-tokens` tokens of distinct random prompts) before
    anything is timed, so that the timed prefill does not include the Triton compiles of its shapes
    (the MoE and MXFP4 tiles are chosen by token count): with only a 3-token warm-up, three runs of the
    same code measured 5.3k-22.6k prefill tokens/s (H100, 2026-11-27)."""
    from atom_like import SamplingParams

    vocab, length = engine.runner.vocab_size, min(args.input_len, engine.max_model_len - 1)
    prompts = [torch.randint(0, vocab, (length,), generator=rng).tolist()
               for _ in range(max(1, args.max_num_batched_tokens // length))]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)


def measure_mode(engine, forced, k: int, args, rng: torch.Generator, dims: KimiDims, weights: dict,
                 kv: tuple[float, float], bandwidth: float, record, out_of_time, skipped: list[str]) -> None:
    """Every concurrency at the two contexts for one engine; `record(row)` after each. A
    concurrency is skipped (named in `skipped`) once `out_of_time()`."""
    vocab = engine.runner.vocab_size
    length = REFERENCE_ACCEPTANCE.get(k, Fraction(k + 1)) if k else None
    for batch in args.concurrency:
        if out_of_time():
            skipped.append(f"{'off' if not k else f'k={k}'} B={batch}")
            continue
        schedule = acceptance_schedule(length, k) if k else None
        first = [torch.randint(0, vocab, (args.input_len,), generator=rng).tolist() for _ in range(batch)]
        near = run_window(engine, forced, first, args.warmup, args.window, schedule, f"k{k}-b{batch}-a",
                          args.profile_steps if batch in args.profile_batches else 0)
        # second window ends at input + output: the prompts grow by what the run would have generated first
        extra = max(1, args.output_len - round((args.warmup + args.window) * near["tokens_per_step"]))
        extended = [p + torch.randint(0, vocab, (extra,), generator=rng).tolist() for p in first]
        far = run_window(engine, forced, extended, args.warmup, args.window, schedule, f"k{k}-b{batch}-b")
        step_ms = (near["step_ms"] + far["step_ms"]) / 2
        per_step = (near["tokens_per_step"] + far["tokens_per_step"]) / 2
        context = (near["context"] + far["context"]) / 2
        roof = step_bytes(weights, kv, dims.experts, dims.top_k, batch, k, context) / (bandwidth * 1e9) * 1e3
        record(dict(mode="off" if not k else f"k={k}", k=k, batch=batch, windows=[near, far], step_ms=step_ms,
                    tokens_per_step=per_step, tokens_per_s_user=per_step / step_ms * 1e3,
                    tokens_per_s_total=batch * per_step / step_ms * 1e3, context=context, roofline_ms=roof,
                    roofline_fraction=roof / step_ms,
                    collectives=collectives_per_step(dims, batch, k, args.tp)))


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3, 4],
                   help="0 = speculation off")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--window", type=int, default=25, help="timed decode steps (25: the acceptance mix repeats)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=10,
                   help="decode steps under torch.profiler after the first window (0: none)")
    p.add_argument("--profile-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="the concurrencies profiled")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch without programmatic dependent launch: each kernel's profiled interval is then its "
                        "own run time (with PDL it includes its wait for the kernel before)")
    p.add_argument("--copy-bytes", type=int, default=4 << 30)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill chunk budget")
    p.add_argument("--deadline", type=float, default=500.0,
                   help="seconds from the start after which no engine is built and no measurement begins "
                        "(what ran is reported; the device call's limit is 600 s)")
    p.add_argument("--device", default="auto")
    p.add_argument("--small", action="store_true", help="4 layers, B 1 and 4, 256 in / 256 out")
    p.add_argument("--tiny", action="store_true", help="tiny dims (the CPU test's): checks the script")
    p.add_argument("--report", metavar="JSON", help="only rewrite the table and plot from a bench_kimi.json "
                                                      "(e.g. where matplotlib is installed)")
    args = p.parse_args(argv)
    if args.small:
        args.layers = args.layers or 4
        args.concurrency, args.input_len, args.output_len = [1, 4], 256, 256
    return args


def main(argv: list[str] | None = None) -> dict:
    from atom_like.config import resolve_device

    args = parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        print(write_report(result, out_dir))
        return result
    start = time.perf_counter()
    dims = TINY if args.tiny else KimiDims()
    if args.layers:
        dims = dataclasses.replace(dims, layers=args.layers)
    device = resolve_device(args.device)
    if args.no_pdl:
        from kernels_rocm import _pdl

        _pdl.set_enabled(False)
    copy = copy_bandwidth(device, args.copy_bytes if device.type == "cuda" else 64 << 20)
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s", flush=True)
    target, draft = write_configs(tempfile.mkdtemp(prefix="bench_kimi_"), dims)
    k_max = max(args.ks)
    engine_args = dict(load_format="dummy", kv_cache_dtype="fp8", device=args.device,
                       max_num_seqs=max(args.concurrency), max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=(args.input_len + args.output_len
                                      + (args.warmup + args.window + 2) * (k_max + 1) + 16))
    blocks_per_seq = -(-engine_args["max_model_len"] // 16) + 1
    # twice what the sequences hold at once, so that the second windows still find their prefixes cached
    engine_args["num_kv_blocks"] = 2 * max(args.concurrency) * blocks_per_seq + 64
    result = dict(meta=dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                            torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rank=args.rank, tp=args.tp,
                            layers=dims.layers, dims=dataclasses.asdict(dims), copy=copy, input_len=args.input_len,
                            output_len=args.output_len, window=args.window, warmup=args.warmup,
                            bus_gbps=BUS_GBPS, pdl=not args.no_pdl, command=" ".join(sys.argv), draft_gib=0.0),
                  rows=[], builds={}, skipped=[])

    def out_of_time() -> bool:
        return time.perf_counter() - start > args.deadline

    def save() -> None:
        (out_dir / "bench_kimi.json").write_text(json.dumps(result, indent=1))

    def record(row: dict) -> None:
        result["rows"].append(row)
        print(f"{row['mode']:>5} B={row['batch']:<3} step {row['step_ms']:.2f} ms  "
              f"{row['tokens_per_s_user']:.1f} tok/s/user  roofline {row['roofline_ms']:.2f} ms "
              f"({100 * row['roofline_fraction']:.0f}%)", flush=True)
        save()

    rng = torch.Generator().manual_seed(0)
    with tp.tp_state(args.rank, args.tp, simulated=True):
        for k in args.ks:
            if out_of_time():
                result["skipped"].append("off" if not k else f"k={k}")
                continue
            built = time.perf_counter()
            engine, forced = build_engine(target, draft if k else None, k, **engine_args)
            runner = engine.runner
            weights, kv = rank_weights(runner), kv_bytes_per_token(runner)
            result["builds"][str(k)] = dict(seconds=time.perf_counter() - built, weights=weights, kv_per_token=kv)
            result["meta"]["weights_gib"] = weights["all"] / 2**30  # the target's
            if k:
                result["meta"]["draft_gib"] = weights["draft_all"] / 2**30
            print(f"engine k={k} built in {time.perf_counter() - built:.1f} s: weights "
                  f"{weights['all'] / 2**30:.2f} GiB", flush=True)
            warm_up_prefill(engine, args, rng)
            measure_mode(engine, forced, k, args, rng, dims, weights, kv, copy["gbps"], record, out_of_time,
                         result["skipped"])
            if not k and any(r["k"] == 0 for r in result["rows"]):
                near = max((r for r in result["rows"] if r["k"] == 0), key=lambda r: r["batch"])["windows"][0]
                result["prefill"] = dict(batch=max(args.concurrency), tokens=near["prefill_tokens"],
                                         seconds=near["prefill_s"],
                                         tokens_per_s=near["prefill_tokens"] / near["prefill_s"])
            engine = forced = runner = None
            gc.collect()
            if device.type == "cuda":  # the next engine needs this one's memory: say if any of it stayed
                torch.cuda.empty_cache()
                result["builds"][str(k)]["allocated_after_release_gib"] = torch.cuda.memory_allocated(device) / 2**30
            write_report(result, out_dir)  # what ran so far, should a later engine overrun the call
    result["seconds"] = time.perf_counter() - start
    save()
    print(write_report(result, out_dir))
    return result


if __name__ == "__main__":
    main()
