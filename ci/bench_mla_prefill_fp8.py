"""What an fp8 latent cache costs MLA prefill (issue 12): the MLA layer's expanded form (prefill) over a
bf16 cache against the same over an fp8 e4m3fn cache, whose step rows are attended unquantized (as the
write kernel made them, its `rows_out`), at Kimi-K2.5's TP8 rank shape
(8 heads, latent 512 + rope 64, nope 128, v 128), Triton backend, bf16. Cases: a prompt of T tokens,
and a chunk of T tokens over T cached ones. Median ms of 20 timed calls (CUDA events) after 3 warm-up
calls. Writes $OUT/bench_mla_prefill_fp8.json.

    OUT=dir python ci/bench_mla_prefill_fp8.py
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig  # noqa: E402

from model_ops.attention.backends import TritonMLABackend  # noqa: E402
from model_ops.attention.metadata import AttentionMetadata, slots_for_positions  # noqa: E402
from model_ops.attention.mla import MLAAttention  # noqa: E402
from model_ops.layernorm import RMSNorm  # noqa: E402
from model_ops.quant.fp8 import quantize_fp8  # noqa: E402
from model_ops.rotary import RotaryEmbedding  # noqa: E402

HEADS, LATENT, NOPE, ROPE, V, BLOCK = 8, 512, 128, 64, 128, 16
CUDA = torch.device("cuda")


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def case(tokens: int, cached: int, g: torch.Generator) -> dict:
    ctx = cached + tokens
    blocks = -(-ctx // BLOCK)
    tables = torch.arange(blocks, dtype=torch.int32, device=CUDA)[None]
    positions = torch.arange(cached, ctx, device=CUDA)
    meta = AttentionMetadata(torch.tensor([0, tokens], dtype=torch.int32, device=CUDA),
                             torch.tensor([ctx], dtype=torch.int32, device=CUDA), tables,
                             slots_for_positions(tables.expand(tokens, -1), positions, BLOCK), tokens, ctx)
    layer = MLAAttention(HEADS, LATENT, NOPE, ROPE, V, scale=(NOPE + ROPE) ** -0.5).to(CUDA, torch.bfloat16)
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(torch.randn(layer.kv_b_proj.weight.shape, generator=g) * 0.05)
    norm = RMSNorm(LATENT).to(CUDA, torch.bfloat16)
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=ROPE * 2, num_attention_heads=2), ROPE, interleaved=True).to(CUDA)
    rope = (rotary, rotary.cos_sin(positions, torch.bfloat16))
    bf = lambda *shape: (torch.randn(*shape, generator=g) * 0.5).to(CUDA, torch.bfloat16)  # noqa: E731
    q_nope, q_pe, latent, k_pe = bf(tokens, HEADS, NOPE), bf(tokens, HEADS, ROPE), bf(tokens, LATENT), bf(tokens, ROPE)
    old = bf(blocks, BLOCK, LATENT + ROPE)
    scale = torch.tensor([0.05], device=CUDA)
    out = dict(tokens=tokens, cached=cached)
    for name, cache, scales in (("bf16", old.clone(), None),
                                ("fp8", quantize_fp8(old.float(), scale, torch.float8_e4m3fn), (scale,))):
        layer.bind_kv_cache(cache, TritonMLABackend(), scales)
        with torch.no_grad():
            out[f"{name}_ms"] = timed(lambda: layer.attend(q_nope, q_pe, latent, k_pe, meta, absorbed=False, rope=rope,
                                                           latent_norm=norm))
    out["fp8_over_bf16"] = out["fp8_ms"] / out["bf16_ms"]
    return out


def main() -> None:
    g = torch.Generator().manual_seed(0)
    rows = [case(tokens, cached, g) for tokens, cached in ((1024, 0), (4096, 0), (8192, 0), (2048, 2048))]
    for r in rows:
        print(f"T {r['tokens']:5d} over {r['cached']:5d} cached: bf16 {r['bf16_ms']:.3f} ms, fp8 {r['fp8_ms']:.3f} ms "
              f"({r['fp8_over_bf16']:.3f}x)")
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_mla_prefill_fp8.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                                               indent=1))


if __name__ == "__main__":
    main()
