"""MLA decode: this tree's kernel against a baseline version of kernels_rocm/mla_decode.py, same run.

Times both with ci/bench_mxfp4.py's `bench_mla` (CUDA-graph replays, L2 flushed between
repetitions, medians; 8 heads, 512 + 64, block 16, bf16 and fp8 e4m3fn caches, batch 1/8/32/64 x
8k/32k; relative error against the fp32 reference where batch x context <= 8 x 32k) after one
copy-bandwidth measurement, then this tree's kernel once more at batch 64 / 32k as a noise check.

Usage: git show main:kernels_rocm/mla_decode.py > /tmp/mla_decode_main.py
       python ci/bench_mla_compare.py --baseline /tmp/mla_decode_main.py [--out DIR]
Writes bench_mla_compare.json to DIR (default $OUT or ./bench_out) and prints one line a row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

import bench_mxfp4 as bm  # noqa: E402
from gpu_timing import ab_header, load_kernel_version  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a version of kernels_rocm/mla_decode.py")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla_compare: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    result = ab_header(args.baseline)
    copy = result["copy"]
    new_fn = bm.mla_paged_attention
    runs = (("new", new_fn, bm.MLA_BATCHES, bm.MLA_CONTEXTS),
            ("old", load_kernel_version(args.baseline, "mla_decode_baseline").mla_paged_attention, bm.MLA_BATCHES, bm.MLA_CONTEXTS),
            ("new_again", new_fn, (64,), (32768,)))
    failed = False
    try:
        for label, fn, batches, contexts in runs:
            bm.mla_paged_attention = fn  # bench_mla calls the module attribute
            rows = [asdict(r) for r in bm.bench_mla(copy["gbps"], batches=batches, contexts=contexts)]
            result[label] = rows
            for r in rows:
                failed |= r["rel_err"] is not None and not r["rel_err"] <= bm.REL_TOL
                print(f"{label:9s} {r['kv']:10s} b={r['batch']:3d} ctx={r['context']:6d} {r['us']:8.1f} us "
                      f"{r['fraction_of_copy'] * 100:5.1f}%  err {r['rel_err']}", flush=True)
            (args.out / "bench_mla_compare.json").write_text(json.dumps(result, indent=2))
    finally:
        bm.mla_paged_attention = new_fn
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
