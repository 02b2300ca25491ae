"""Decode against the bandwidth roofline, on the Llama-3.1-8B shape, in one run (< 9 min on an H100).

Parts (all by default; `--parts` picks some):
* copy: device-to-device copy bandwidth (bytes read + written / time, median of 10), the roofline's
  denominator.
* transformers: `generate` with a static KV cache (no torch.compile) on the same random weights, at
  each batch size: tokens/s = batch * (max_tokens - 1) / (t(max_tokens) - t(1)), medians of 3.
* engine: atom_like, bf16, CUDA graphs, `--prompt-len` random-token prompts, at batch 1, 16, 64:
  decode steps only (prefill untimed), step ms, tokens/s, and % of roofline, where roofline ms =
  (every weight read once + each sequence's KV at the mean context) / copy bandwidth
  (bench_models.decode_step_bytes).
* profile: torch.profiler over `--profile-steps` decode steps at batch 1 and 16: GPU idle % of the
  steps' span (1 - union of kernel/memcpy intervals / first start .. last end), kernels and
  memcpys per step, CUDA/HIP synchronize calls per step (cudaStreamSynchronize & co, host side),
  and the top kernels by time; then a second pass tracing the device alone, whose idle % is free
  of the host slow-down that tracing host ops causes.
* nopdl: a second engine with programmatic dependent launch off (kernels_rocm._pdl.set_enabled),
  batch 1: step ms and the device-only profile, beside the first engine's (A/B in one run).
* fusions: a layer's rope + KV write and SiLU-and-mul at the 8B shape for T = 1, 16, 64 tokens,
  eager (model_ops.rotary + kernels_rocm.kv_cache; F.silu * up) vs the fused Triton kernel.
* gemm: the skinny projections of the 8B shape (qkv, o_proj, gate_up, down, lm_head) at M = 1, 2,
  4, 8 (`--gemm-m`): cuBLAS (F.linear) vs kernels_rocm.skinny_gemm (the GEMV-style Triton kernel)
  over a sweep of launch configs (block_n x num_warps, `gemv_sweep`), each first checked against
  the fp32 product (relative error < 4e-3), then timed as a model calls it (validation and output
  allocation included; do_bench with the L2 flushed, so host launch time hides behind the flush as
  it does under CUDA graphs). Reports µs and % of copy bandwidth (weight bytes / time) for cuBLAS,
  the best config and the default one (skinny_gemm.default_config); every config's µs is in the
  JSON (`sweep`). The engine keeps F.linear; `winner` is the data a model-side switch would use.

`--smoke` runs every part on a tiny Llama on the CPU (fp32, eager, Triton in the interpreter) in
under a minute: it checks the script, not the speed.

    OUT=dir python ci/bench_roofline.py [--parts copy,transformers,engine,profile,gemm] [--smoke]
    results: $OUT/bench_roofline.json and $OUT/bench_roofline.md (default folder ./bench_out)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
if "--smoke" in sys.argv:  # Triton reads the flag when a kernel is decorated (at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from profile_tables import idle_stats, kernel_table, profile_calls  # noqa: E402

PARTS = ("copy", "fusions", "transformers", "engine", "profile", "nopdl", "gemm")
PROMPT_SEED = 0


def llama_config(smoke: bool):
    from transformers import LlamaConfig

    common = dict(max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if smoke:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, **common)
    return LlamaConfig(  # Llama-3.1-8B
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, **common)


class Clock:
    """Wall time with the device drained first (a no-op on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object], reps: int = 1) -> float:
        """Median seconds of `reps` calls."""
        times = []
        for _ in range(reps):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def kernel_us(self, fn: Callable[[], object]) -> float:
        """Median microseconds of one call: triton's do_bench (L2 flushed) on a GPU, a short loop on the CPU."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return 1e3 * do_bench(fn, warmup=10, rep=40)
        fn()
        return 1e6 * self.time(fn, reps=3)


def copy_bandwidth(clock: Clock, num_bytes: int) -> dict:
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=clock.device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = clock.time(lambda: dst.copy_(src), reps=10)
    del src, dst
    return dict(bytes=2 * num_bytes, ms=1e3 * seconds, gbps=2 * num_bytes / seconds / 1e9)


def save_checkpoint(config, folder: str, device: torch.device, dtype: torch.dtype):
    """Random weights in `dtype`, written as an HF checkpoint; returns (path, the HF model)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # fp32 first, as transformers initialises it (8B: 32 GB, then 16 GB in bf16)
        model = LlamaForCausalLM(config).to(dtype).eval()
    path = os.path.join(folder, "llama")
    model.save_pretrained(path)
    return path, model


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(PROMPT_SEED + batch)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def bench_transformers(model, clock: Clock, batches: list[int], prompt_len: int, max_tokens: int) -> list[dict]:
    model.generation_config.eos_token_id = None
    rows = []
    for batch in batches:
        ids = torch.tensor(prompts(batch, prompt_len, model.config.vocab_size), device=clock.device)

        def generate(n: int) -> None:
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True)

        generate(max_tokens)  # warm-up
        first, full = clock.time(lambda: generate(1), reps=3), clock.time(lambda: generate(max_tokens), reps=3)
        seconds = full - first
        rows.append(dict(batch=batch, tokens_per_s=batch * (max_tokens - 1) / seconds,
                         step_ms=1e3 * seconds / (max_tokens - 1)))
    return rows


def start_batch(engine, batch_prompts: list[list[int]], max_tokens: int) -> None:
    """Add the requests and step until each holds its first token (the prefill, never timed)."""
    from atom_like import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in batch_prompts}
    started: set[str] = set()
    while started != ids:
        started |= {out.request_id for out in engine.step() if out.token_ids}


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def bench_engine(engine, clock: Clock, batches: list[int], prompt_len: int, max_tokens: int, copy_gbps: float) -> list[dict]:
    from bench_models import decode_step_bytes

    rows = []
    for batch in batches:
        batch_prompts = prompts(batch, prompt_len, engine.runner.vocab_size)
        sync_ms = None
        for overlap in (False, True):  # side by side: one step at a time, then overlapped scheduling
            engine.args.overlap_scheduling = overlap
            for _ in range(2):  # the first round warms up; the second is the one kept
                start_batch(engine, batch_prompts, max_tokens)
                seconds = clock.time(lambda: drain(engine))
            step_ms = 1e3 * seconds / (max_tokens - 1)
            sync_ms = sync_ms or step_ms
        roofline_ms = 1e3 * decode_step_bytes(engine, batch, prompt_len + max_tokens // 2, 0) / (copy_gbps * 1e9)
        rows.append(dict(batch=batch, step_ms=step_ms, sync_step_ms=sync_ms, tokens_per_s=batch * (max_tokens - 1) / seconds,
                         roofline_ms=roofline_ms, fraction_of_roofline=roofline_ms / step_ms))
    return rows


def _profiled_steps(engine, clock: Clock, batch: int, prompt_len: int, steps: int, activities: list):
    start_batch(engine, prompts(batch, prompt_len, engine.runner.vocab_size), steps + 8)
    for _ in range(3):
        engine.step()
    prof, wall = profile_calls(engine.step, steps, activities, clock.sync)
    drain(engine)
    return prof, wall


def profile_engine(engine, clock: Clock, batch: int, prompt_len: int, steps: int) -> dict:
    """Host and device activity (syncs, host ops, kernels), then, on a GPU, device activity alone:
    tracing host ops slows the host, which a GPU waiting on it counts as idle time, so the idle
    figure of the second pass is the one to trust."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.device.type == "cuda" else [])
    prof, wall = _profiled_steps(engine, clock, batch, prompt_len, steps, activities)
    device_events = [e for e in prof.events() if e.device_type != DeviceType.CPU]
    host_events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    syncs = defaultdict(int)
    for e in prof.events():  # runtime calls: cudaStreamSynchronize, cudaDeviceSynchronize, hip*..., and .item()
        if e.name.endswith("Synchronize") or e.name == "aten::_local_scalar_dense":
            syncs[e.name] += 1
    result = dict(batch=batch, steps=steps, wall_ms_per_step=1e3 * wall / steps,
                  syncs_per_step={k: v / steps for k, v in sorted(syncs.items())},
                  host_ops_per_step=len(host_events) / steps)
    if device_events:
        result.update(kernel_table(device_events, steps))
        prof, wall = _profiled_steps(engine, clock, batch, prompt_len, steps, [ProfilerActivity.CUDA])
        device_only = idle_stats([e for e in prof.events() if e.device_type != DeviceType.CPU], steps)
        result["device_only"] = dict(wall_ms_per_step=1e3 * wall / steps, **device_only)
    return result


def bench_fusions(clock: Clock, tokens: list[int], smoke: bool) -> list[dict]:
    import torch.nn.functional as F

    from kernels_rocm.activation import silu_and_mul
    from kernels_rocm.kv_cache import write_kv_cache
    from kernels_rocm.rope_kv_cache import rope_write_kv_cache
    from model_ops.rotary import RotaryEmbedding

    config = llama_config(smoke)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    dtype = torch.float32 if smoke else torch.bfloat16
    with torch.device(clock.device):
        rotary = RotaryEmbedding(config, dim)
    g = torch.Generator(device=clock.device).manual_seed(0)
    cache = torch.randn(2, 256, 16, kv_heads, dim, generator=g, device=clock.device).to(dtype)
    rows = []
    for t in tokens:
        qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g, device=clock.device).to(dtype)
        q, k, v = (x.view(t, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
        cos, sin = rotary.cos_sin(torch.randint(0, 4096, (t,), device=clock.device), dtype)
        slots = torch.randperm(256 * 16, device=clock.device)[:t]

        def eager_rope():
            write_kv_cache(rotary.apply(k, cos, sin), v, cache[0], cache[1], slots)
            return rotary.apply(q, cos, sin)

        x = torch.randn(t, 2 * config.intermediate_size, generator=g, device=clock.device).to(dtype)

        def eager_silu():
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up

        for name, eager, fused in (
            ("rope + KV write", eager_rope, lambda: rope_write_kv_cache(q, k, v, cache[0], cache[1], cos, sin, slots)),
            ("SiLU-and-mul", eager_silu, lambda: silu_and_mul(x)),
        ):
            eager_us, fused_us = clock.kernel_us(eager), clock.kernel_us(fused)
            rows.append(dict(op=name, tokens=t, eager_us=eager_us, fused_us=fused_us, speedup=eager_us / fused_us))
    return rows


GEMM_SHAPES = {  # name -> (N, K) of the Llama-3.1-8B projections (weights [N, K])
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LLAMA8B_TP2_SHAPES = {  # one rank of the 8B at -tp 2: column-parallel N halved, row-parallel K halved
    "tp2 qkv": (3072, 4096), "tp2 o_proj": (4096, 2048), "tp2 gate_up": (14336, 4096), "tp2 down": (4096, 7168),
    "tp2 lm_head": (64128, 4096),
}
KIMI_TP8_SHAPES = {  # one TP8 rank of Kimi-K2.5: the MLA projections and the router (bench_kimi's decode step)
    "kimi fused_qkv_a": (2112, 7168), "kimi q_b": (1536, 1536), "kimi o_proj": (7168, 1024),
    "kimi router": (384, 7168), "kimi lm_head": (20480, 7168),
}
SHAPE_SETS = {"llama8b": GEMM_SHAPES, "llama8b-tp2": LLAMA8B_TP2_SHAPES, "kimi": KIMI_TP8_SHAPES}
GEMV_BLOCK_N = (1, 2, 4, 8, 16, 32)


def gemv_sweep(m: int) -> list:
    """skinny_gemm launch configs timed at M rows: block_n x num_warps under the register cap
    (block_n x M padded to a power of two <= 64): 20 configs at M 1-2, 16 at M 4, 12 at M 8."""
    from kernels_rocm.skinny_gemm import NUM_WARPS, GemvConfig

    padded = 1 << (m - 1).bit_length()
    return [GemvConfig(block_n, warps) for block_n in GEMV_BLOCK_N for warps in NUM_WARPS if block_n * padded <= 64]


def _config_name(config) -> str:
    return f"{config.block_n}x{config.num_warps}w"


def bench_gemm(clock: Clock, ms: list[int], copy_gbps: float, smoke: bool, shape_set: str = "llama8b") -> list[dict]:
    import torch.nn.functional as F

    from kernels_rocm._util import num_compute_units
    from kernels_rocm.skinny_gemm import GemvConfig, default_config, skinny_gemm

    dtype = torch.float32 if smoke else torch.bfloat16
    shapes = {"smoke": (72, 96)} if smoke else SHAPE_SETS[shape_set]
    g = torch.Generator(device=clock.device).manual_seed(0)
    rows = []
    for name, (n, k) in shapes.items():
        start = time.perf_counter()
        w = (torch.randn(n, k, generator=g, device=clock.device) * 0.02).to(dtype)
        weight_bytes = w.numel() * w.element_size()
        for m in ms:
            x = torch.randn(m, k, generator=g, device=clock.device).to(dtype)
            ref = F.linear(x.float(), w.float())
            cublas_us = clock.kernel_us(lambda: F.linear(x, w))
            default = default_config(m, n, num_compute_units(clock.device))
            configs = [GemvConfig(8, 1), GemvConfig(4, 2)] if smoke else gemv_sweep(m)
            sweep = {}
            for config in dict.fromkeys([default, *configs]):  # the default first, once
                out = skinny_gemm(x, w, config).float()
                err = ((out - ref).norm() / ref.norm()).item()
                if err > 4e-3:
                    raise AssertionError(f"skinny_gemm {name} M={m} {config}: relative error {err:.2e}")
                sweep[_config_name(config)] = clock.kernel_us(lambda: skinny_gemm(x, w, config))
            best = min(sweep, key=sweep.get)
            of_copy = lambda us: weight_bytes / us / 1e3 / copy_gbps  # noqa: E731
            rows.append(dict(shape=name, n=n, k=k, m=m, cublas_us=cublas_us, cublas_of_copy=of_copy(cublas_us),
                             triton_us=sweep[best], triton_of_copy=of_copy(sweep[best]), triton_config=best,
                             default_config=_config_name(default), default_us=sweep[_config_name(default)],
                             default_of_copy=of_copy(sweep[_config_name(default)]),
                             winner="triton" if sweep[best] < cublas_us else "cublas", sweep=sweep))
        del w
        print(f"[bench_roofline] gemm {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"## Decode against the roofline: {meta['model']}, {meta['dtype']}, {meta['device']}",
             "", f"`{meta['command']}`, {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}; "
             f"prompts of {meta['prompt_len']} tokens, {meta['max_tokens']} generated (decode steps only).", ""]
    if "copy" in results:
        lines += [f"Copy bandwidth: **{results['copy']['gbps']:.0f} GB/s** (read + written).", ""]
    if "engine" in results or "transformers" in results:
        hf = {r["batch"]: r for r in results.get("transformers", [])}
        lines += ["| batch | step ms, one at a time | atom_like step ms (overlapped) | roofline ms | % of roofline | "
                  "atom_like tok/s | transformers tok/s | vs transformers |", "|---|---|---|---|---|---|---|---|"]
        for batch in sorted({r["batch"] for r in results.get("engine", [])} | set(hf)):
            e = next((r for r in results.get("engine", []) if r["batch"] == batch), None)
            h = hf.get(batch)
            cells = ([f"{e['sync_step_ms']:.2f}", f"{e['step_ms']:.2f}", f"{e['roofline_ms']:.2f}",
                      f"{e['fraction_of_roofline']:.0%}", f"{e['tokens_per_s']:.1f}"] if e else ["-"] * 5)
            cells += [f"{h['tokens_per_s']:.1f}" if h else "-",
                      f"{e['tokens_per_s'] / h['tokens_per_s']:.2f}x" if e and h else "-"]
            lines.append(f"| {batch} | " + " | ".join(cells) + " |")
        lines.append("")
    for p in results.get("profile", []):
        syncs = ", ".join(f"{k} {v:.1f}" for k, v in p["syncs_per_step"].items()) or "none"
        lines += [f"### Profile, batch {p['batch']} ({p['steps']} decode steps, torch.profiler)", "",
                  f"wall {p['wall_ms_per_step']:.2f} ms/step (under the profiler); synchronize calls per step: {syncs}; "
                  f"host ops per step {p['host_ops_per_step']:.0f}."]
        if "gpu_idle_fraction" in p:
            lines += [f"GPU busy {p['gpu_busy_ms_per_step']:.2f} of {p['gpu_span_ms_per_step']:.2f} ms per step: "
                      f"**idle {p['gpu_idle_fraction']:.1%}**; {p['kernels_per_step']:.0f} kernels and "
                      f"{p['copies_per_step']:.1f} memcpy/memset per step. Tracing the device alone (no host ops): "
                      f"wall {p['device_only']['wall_ms_per_step']:.2f} ms/step, GPU busy "
                      f"{p['device_only']['gpu_busy_ms_per_step']:.2f} of {p['device_only']['gpu_span_ms_per_step']:.2f} "
                      f"ms: **idle {p['device_only']['gpu_idle_fraction']:.1%}**.", "",
                      "| kernel | us / step | calls / step |", "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['us_per_step']:.1f} | {k['calls_per_step']:.1f} |" for k in p["top_kernels"]]
        lines.append("")
    if nopdl := results.get("nopdl"):
        with_pdl = next((r for r in results.get("engine", []) if r["batch"] == 1), None)
        with_profile = next((p for p in results.get("profile", []) if p["batch"] == 1), None)

        def row(label, e, p):
            idle = p.get("device_only", p).get("gpu_idle_fraction") if p else None
            return (f"| {label} | {e['step_ms']:.2f} | {e['fraction_of_roofline']:.0%} | "
                    + (f"{idle:.1%} | {p['kernels_per_step']:.0f} |" if idle is not None else "- | - |"))
        lines += ["### Programmatic dependent launch on / off, batch 1 (two engines, same run)", "",
                  "| PDL | step ms (overlapped) | % of roofline | GPU idle (device-only profile) | kernels / step |",
                  "|---|---|---|---|---|"]
        if with_pdl:
            lines.append(row("on", with_pdl, with_profile))
        lines += [row("off", nopdl["engine"][0], nopdl["profile"]), ""]
    if results.get("fusions"):
        lines += ["### Fused decode ops vs their eager versions (one layer)", "",
                  "| op | tokens | eager us | fused us | speedup |", "|---|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['tokens']} | {r['eager_us']:.1f} | {r['fused_us']:.1f} | {r['speedup']:.1f}x |"
                  for r in results["fusions"]]
        lines.append("")
    if results.get("gemm"):
        lines += ["### Skinny GEMMs: cuBLAS (F.linear) vs GEMV-style Triton (kernels_rocm.skinny_gemm)", "",
                  "Triton configs are block_n x num_warps; best of the sweep, and the default_config's.", "",
                  "| shape | N x K | M | cuBLAS us | % of copy | best Triton us | % of copy | best config | "
                  "default us | % of copy | default config | faster |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['n']}x{r['k']} | {r['m']} | {r['cublas_us']:.1f} | {r['cublas_of_copy']:.0%} | "
                  f"{r['triton_us']:.1f} | {r['triton_of_copy']:.0%} | {r['triton_config']} | {r['default_us']:.1f} | "
                  f"{r['default_of_copy']:.0%} | {r['default_config']} | {r['winner']} |"
                  for r in results["gemm"]]
        lines.append("")
    lines.append("Part times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["part_seconds"].items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--hf-batch-sizes", default="", help="transformers' batch sizes (default: --batch-sizes)")
    parser.add_argument("--profile-batch-sizes", default="1,16")
    parser.add_argument("--profile-steps", type=int, default=50)
    parser.add_argument("--gemm-shapes", choices=tuple(SHAPE_SETS), default="llama8b",
                        help="the projections swept: Llama-3.1-8B's, one of its -tp 2 ranks', or a Kimi-K2.5 TP8 "
                             "rank's (MLA, router, LM head)")
    parser.add_argument("--gemm-m", default="1,2,4,8", help="rows of x (at most skinny_gemm.MAX_M)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU: checks the script in < 1 min")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown --parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    from kernels_rocm.skinny_gemm import MAX_M

    if any(not 1 <= int(m) <= MAX_M for m in args.gemm_m.split(",")):
        parser.error(f"--gemm-m {args.gemm_m}: each M must be in 1..{MAX_M} (skinny_gemm's range)")
    if args.smoke:
        args.prompt_len, args.max_tokens, args.profile_steps = 12, 6, 4
        args.batch_sizes, args.profile_batch_sizes, args.gemm_m = "1,3", "2", "1,5"
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    clock = Clock(device)
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    hf_batches = [int(b) for b in args.hf_batch_sizes.split(",")] if args.hf_batch_sizes else batches
    import transformers

    results: dict = dict(meta=dict(
        model="Llama shape, 2 layers (smoke)" if args.smoke else "Llama-3.1-8B shape (random init)",
        dtype=str(dtype).removeprefix("torch."), device=torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
        torch=torch.__version__, transformers=transformers.__version__, date=time.strftime("%Y-%m-%d", time.gmtime()),
        command="python ci/bench_roofline.py " + " ".join(sys.argv[1:]), prompt_len=args.prompt_len,
        max_tokens=args.max_tokens), part_seconds={})

    def write() -> str:
        text = markdown(results)
        with open(os.path.join(out_dir, "bench_roofline.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(out_dir, "bench_roofline.md"), "w") as f:
            f.write(text)
        return text

    def timed_part(name: str, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        results[name] = fn()
        results["part_seconds"][name] = time.perf_counter() - start
        print(f"[bench_roofline] {name}: {results['part_seconds'][name]:.0f} s", flush=True)
        write()  # after every part: a run cut short by a time limit keeps what it measured

    timed_part("copy", lambda: copy_bandwidth(clock, (64 << 20) if args.smoke else (2 << 30)))
    copy_gbps = results["copy"]["gbps"]
    if "fusions" in parts:
        timed_part("fusions", lambda: bench_fusions(clock, [2, 5] if args.smoke else [1, 16, 64], args.smoke))
    if "gemm" in parts:
        timed_part("gemm", lambda: bench_gemm(clock, [int(m) for m in args.gemm_m.split(",")], copy_gbps, args.smoke,
                                              args.gemm_shapes))
    with tempfile.TemporaryDirectory() as folder:
        if {"transformers", "engine", "profile"} & set(parts):
            start = time.perf_counter()
            path, model = save_checkpoint(llama_config(args.smoke), folder, device, dtype)
            results["part_seconds"]["checkpoint"] = time.perf_counter() - start
            if "transformers" in parts:
                timed_part("transformers",
                           lambda: bench_transformers(model, clock, hf_batches, args.prompt_len, args.max_tokens))
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if {"engine", "profile", "nopdl"} & set(parts):
            from atom_like import LLMEngine

            def build_engine():
                return LLMEngine(path, dtype=str(dtype).removeprefix("torch."), device=device.type,
                                 max_model_len=args.prompt_len + args.max_tokens + args.profile_steps + 16,
                                 max_num_seqs=max(batches), gpu_memory_utilization=0.85)

            start = time.perf_counter()
            engine = build_engine()
            results["part_seconds"]["engine_start"] = time.perf_counter() - start
            results["meta"]["attention_backends"] = sorted(
                {type(b.backend).__name__ for b in engine.runner.builders})
            results["meta"]["graphs"] = engine.runner.graphs is not None
            if "engine" in parts:
                timed_part("engine", lambda: bench_engine(engine, clock, batches, args.prompt_len, args.max_tokens,
                                                          copy_gbps))
            if "profile" in parts:
                timed_part("profile", lambda: [profile_engine(engine, clock, int(b), args.prompt_len, args.profile_steps)
                                               for b in args.profile_batch_sizes.split(",")])
            if "nopdl" in parts:
                from kernels_rocm import _pdl

                engine.shutdown()
                del engine
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                _pdl.set_enabled(False)  # kernels and graphs of the new engine launch without PDL
                engine = build_engine()
                timed_part("nopdl", lambda: dict(
                    engine=bench_engine(engine, clock, [1], args.prompt_len, args.max_tokens, copy_gbps),
                    profile=profile_engine(engine, clock, 1, args.prompt_len, args.profile_steps)))
    print(write())


if __name__ == "__main__":
    main()
