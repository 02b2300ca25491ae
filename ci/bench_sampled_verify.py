"""Decode step time at T = 1 with the sampled-verification kernels (kernels_rocm/sampled_verify.py) on
and off, in one process on one GPU: off is model_ops.sampling._sampled_verify_kernel patched to None,
i.e. the torch path every other step takes. Fixed k = 0, 1, 3 on the dummy-weight SmolLM2 shape with
its EAGLE3 draft, decode graphs, one running batch of B sequences; modes in interleaved turns (8 turns
of 48 timed steps each, forwards then backwards). Median and lower quartile per mode into
$OUT/sampled_verify_b{B}.json (docs/benchmarks.md section 11).

    OUT=dir B=1 python ci/bench_sampled_verify.py
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "ci")]

import bench_adaptive as ba  # noqa: E402
import model_ops.sampling as sampling  # noqa: E402
from atom_like import LLMEngine, SamplingParams  # noqa: E402
from spec_decode.adaptive import FixedDraftLength  # noqa: E402

SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152)


def main() -> None:
    out, batch = os.environ["OUT"], int(os.environ.get("B", 1))
    target, draft = ba.write_configs(Path(tempfile.mkdtemp()), SMOL, "bfloat16")
    engine = LLMEngine(target, method="eagle3", draft_model=draft, num_speculative_tokens=5, speculative_adaptive=True,
                       load_format="dummy", max_model_len=8192, max_num_seqs=max(batch, 8),
                       enable_prefix_caching=False, gpu_memory_utilization=0.3)
    kernel = sampling._sampled_verify_kernel
    params = SamplingParams(temperature=1.0, max_tokens=7000, ignore_eos=True)
    for prompt in ba.random_prompts(batch, 64, SMOL["vocab_size"], 1):
        engine.add_request(None, params, prompt_ids=prompt)
    for _ in range(5):
        engine.step()
    gc.collect()
    gc.freeze()
    modes = [(k, on) for k in (0, 1, 3) for on in (True, False)]
    times: dict[str, list[float]] = {f"k{k}_{'kernel' if on else 'torch'}": [] for k, on in modes}
    for turn in range(8):
        for k, on in modes if turn % 2 == 0 else modes[::-1]:
            sampling._sampled_verify_kernel = kernel if on else (lambda *args: None)
            engine.draft_policy = FixedDraftLength(k)
            for _ in range(8):  # the pipeline turns over to this mode
                engine.step()
            last = time.perf_counter()
            for _ in range(48):
                engine.step()
                now = time.perf_counter()
                times[f"k{k}_{'kernel' if on else 'torch'}"].append(now - last)
                last = now
    result = {mode: dict(median_ms=statistics.median(t) * 1e3, p25_ms=statistics.quantiles(t, n=4)[0] * 1e3, n=len(t))
              for mode, t in times.items()}
    for mode, r in result.items():
        print(f"batch {batch} T=1 {mode}: median {r['median_ms']:.3f} ms, lower quartile {r['p25_ms']:.3f} ms")
    with open(os.path.join(out, f"sampled_verify_b{batch}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), batch=batch, modes=result), f, indent=1)


if __name__ == "__main__":
    main()
