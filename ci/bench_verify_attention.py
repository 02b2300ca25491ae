"""Paged MHA attention at speculative-verify widths, this tree's kernel against a saved version.

The Llama-3.1-8B shape (32 q / 8 kv heads, D 128, block 16, bf16 KV), batch 32 / 64 / 96 / 128,
contexts 1k / 2k / 4k, query rows a sequence q = 4..6 (a verify of k = q - 1 drafts): µs a call
(do_bench median, L2 flushed) of the saved version ("old"), this tree's ("new": its choice of tile),
and this tree's with every sequence's rows in one program ("one tile":
VERIFY_ONE_TILE_PROGRAMS_PER_CU = 0); fraction of the copy bandwidth measured in the same run for the
KV read once (what a verify must move), and the largest difference between old and new outputs.

    git show main:kernels_rocm/paged_attention.py > /tmp/paged_attention_main.py
    python ci/bench_verify_attention.py --baseline /tmp/paged_attention_main.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "ci"))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from gpu_timing import ab_header, load_kernel_version  # noqa: E402
import kernels_rocm.paged_attention as pa_mod  # noqa: E402
from kernels_rocm.paged_attention import paged_attention  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def kv_pool(batch: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 K/V pool [2, blocks, BLOCK, KV_HEADS, DIM] and each sequence's blocks, shuffled."""
    blocks_per_seq = -(-context // BLOCK)
    pool = torch.randn(2, batch * blocks_per_seq + 1, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda",
                       dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks_per_seq, generator=gen, device="cuda").view(batch, blocks_per_seq)
    return pool, tables.to(torch.int32)


def case(pool: torch.Tensor, tables: torch.Tensor, context: int, q_len: int, gen: torch.Generator) -> tuple:
    """paged_attention's arguments: every sequence at `context` tokens, its last q_len the queries."""
    batch = tables.shape[0]
    q = torch.randn(batch * q_len, HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    starts = (torch.arange(batch + 1, device="cuda") * q_len).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, pool[0], pool[1], starts, lens, tables, q_len, context, DIM**-0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a saved kernels_rocm/paged_attention.py")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    args = parser.parse_args()
    old = load_kernel_version(args.baseline, "paged_attention_baseline").paged_attention
    result = ab_header(args.baseline)
    copy = result["copy"]["gbps"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    threshold = pa_mod.VERIFY_ONE_TILE_PROGRAMS_PER_CU

    def one_tile(*call):
        pa_mod.VERIFY_ONE_TILE_PROGRAMS_PER_CU = 0
        try:
            return paged_attention(*call)
        finally:
            pa_mod.VERIFY_ONE_TILE_PROGRAMS_PER_CU = threshold

    rows = []
    for batch in (32, 64, 96, 128):
        for context in (1024, 2048, 4096):
            pool, tables = kv_pool(batch, context, gen)
            kv_bytes = batch * context * KV_HEADS * DIM * 2 * 2  # K and V, bf16, read once
            for q_len in (4, 5, 6):
                call = case(pool, tables, context, q_len, gen)
                row = dict(batch=batch, context=context, q=q_len,
                           max_diff=(paged_attention(*call).float() - old(*call).float()).abs().max().item())
                for name, fn in (("old", old), ("new", paged_attention), ("one_tile", one_tile)):
                    row[f"{name}_us"] = do_bench(lambda: fn(*call), return_mode="median") * 1e3
                    row[f"{name}_copy"] = kv_bytes / row[f"{name}_us"] / 1e3 / copy
                rows.append(row)
                print(f"batch {batch} ctx {context} q {q_len}: old {row['old_us']:.1f} us ({row['old_copy']:.0%}), "
                      f"new {row['new_us']:.1f} ({row['new_copy']:.0%}), one tile {row['one_tile_us']:.1f} "
                      f"({row['one_tile_copy']:.0%}); max diff {row['max_diff']:.2e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_verify_attention.json").write_text(json.dumps({**result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
