"""bench_tp's markdown report (ci/bench_tp.py writes the JSON it reads)."""
from __future__ import annotations


def markdown(data: dict, tp: int) -> str:
    meta = data["meta"]
    lines = [f"Tensor parallelism, {meta['device']} x{meta['gpus']}, torch {meta['torch']}, bf16, CUDA graphs, {meta['date']}.", ""]
    if data["speed"]:
        lines += ["| model | tp | all-reduce | batch | tokens/s | step ms | vs tp 1 | weights GiB / rank | "
                  "collectives ms / step alone (graph) |", "|---|---|---|---|---|---|---|---|---|"]
        base = {(r["model"], r["batch"]): r["tokens_per_s"] for r in data["speed"] if r["tp"] == 1}
        comm = {(r["model"], r["batch"], reduce): r[col] for r in data["allreduce"]
                for reduce, col in (("nccl", "graph_ms"), ("one-shot", "one_shot_graph_ms"))}
        for r in data["speed"]:
            key = (r["model"], r["batch"])
            ratio = f"{r['tokens_per_s'] / base[key]:.2f}x" if key in base else "-"
            c = comm.get((*key, r.get("all_reduce")))
            coll = f"{c:.3f} ({c / r['step_ms']:.0%})" if r["tp"] > 1 and c is not None else "-"
            lines.append(f"| {r['model']} | {r['tp']} | {r.get('all_reduce', '-')} | {r['batch']} | {r['tokens_per_s']:.1f} | "
                         f"{r['step_ms']:.2f} | {ratio} | {r['weight_gib_per_rank']:.2f} | {coll} |")
        lines.append("")
    if data["allreduce"]:
        lines += ["Collectives of one -tp 2 decode step, alone (2 x layers + 1 all-reduces of [batch, H], one "
                  "all-gather of [batch, V/2]):", "", "| model | batch | collectives | NCCL eager ms | NCCL graph ms | "
                  "one-shot all-reduces, graph ms |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['collectives']} | {r['eager_ms']:.3f} | {r['graph_ms']:.3f} | "
                  f"{r['one_shot_graph_ms']:.3f} |" for r in data["allreduce"]]
        lines.append("")
    if data["allreduce_sweep"]:
        lines += ["One bf16 all-reduce alone, graph-replayed, µs a call (one-shot checked equal to NCCL bit for bit; "
                  "fused: rows of 4096 with the residual add + RMSNorm):", "",
                  "| bytes | NCCL µs | one-shot µs | fused + norm µs |", "|---|---|---|---|"]
        lines += [f"| {r['bytes']} | {r['nccl_us']:.1f} | {r['one_shot_us']:.1f} | "
                  f"{r['fused_norm_us']:.1f} |" if "fused_norm_us" in r else
                  f"| {r['bytes']} | {r['nccl_us']:.1f} | {r['one_shot_us']:.1f} | - |" for r in data["allreduce_sweep"]]
        lines.append("")
    if data["zoo"]:
        lines += ["| target | draft | tp 1 mean acceptance length | tp 2 | identical completions | same tokens |",
                  "|---|---|---|---|---|---|"]
        for r in data["zoo"]:
            if "skipped" in r:
                lines.append(f"| {r['target']} | {r['draft']} | {r['skipped']} | | | |")
                continue
            cells = [f"{r[t]['mean_acceptance_length']:.3f}" if "error" not in r[t] else r[t]["error"][:120]
                     for t in ("tp1", f"tp{tp}")]
            lines.append(f"| {r['target']} | {r['draft']} | {cells[0]} | {cells[1]} | "
                         f"{r.get('identical_completions', '-')} | {r.get('same_tokens_before_first_difference', 0):.1%} |")
    if data["mxfp4"]:
        lines += ["", "DeepSeek-shaped MoE in Quark MXFP4 (released layout), fp8 KV cache:", "",
                  "| tp | batch | tokens/s | step ms | vs tp 1 |", "|---|---|---|---|---|"]
        base = {r["batch"]: r["tokens_per_s"] for r in data["mxfp4"] if r.get("tp") == 1}
        for r in data["mxfp4"]:
            if "tp" in r:
                ratio = f"{r['tokens_per_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
                lines.append(f"| {r['tp']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {ratio} |")
            else:
                lines.append(f"\nGreedy completions identical at -tp 1 and -tp 2: {r['identical_completions']} "
                             f"({r['same_tokens_before_first_difference']:.1%} of tokens before a first difference)")
    for r in data["speed"]:
        for rank, table in enumerate(r.get("profile", [])):
            top = "; ".join(f"{k['name'][:40]} {k['us_per_step']:.0f} us x{k['calls_per_step']:.0f}"
                            for k in table["top_kernels"][:6])
            lines.append(f"\nProfile, {r['model']} tp {r['tp']} ({r['all_reduce']}) batch {r['batch']}, rank {rank}: "
                         f"device busy {table['gpu_busy_ms_per_step']:.3f} of {table['gpu_span_ms_per_step']:.3f} ms a "
                         f"step (idle {table['gpu_idle_fraction']:.1%}), {table['kernels_per_step']:.0f} kernels a "
                         f"step; top: {top}")
    lines += [f"\nERROR ({e['part']}{', ' + e['model'] if 'model' in e else ''}{', tp ' + str(e['tp']) if 'tp' in e else ''}): "
              f"{e['error']}" for e in data["errors"]]
    return "\n".join(lines) + "\n"
