"""ci/bench_kimi.py's report: the markdown table (with the kernel profiles) and the PNG plot of a
bench_kimi.json result (`python ci/bench_kimi.py --report JSON` rewrites them alone)."""
from __future__ import annotations

from pathlib import Path

# Published anchors (other hardware, other engines): reference/anchors_2026_11.md and issue 21.
ANCHORS = ("vLLM, Kimi-K2.5 MXFP4, 8x MI355X, 8k/1k, low batch, no speculation: 78.9 tok/s/user; "
           "ATOM, DeepSeek-R1 MXFP4 + MTP3, 8x MI355X, concurrency 64, 1k/1k: TPOT 10.9 ms. "
           "MI355X has ~1.7x an H200's memory bandwidth (8.0 vs 4.8 TB/s).")


def markdown(result: dict) -> str:
    meta = result["meta"]
    rows = result["rows"]
    off = {r["batch"]: r for r in rows if r["k"] == 0}
    lines = [
        f"Kimi-K2.5-MXFP4 + EAGLE3, rank {meta['rank']} of TP{meta['tp']} on one {meta['device']} "
        f"({meta['layers']} layers; torch {meta['torch']}, {meta['date']}); copy bandwidth "
        f"**{meta['copy']['gbps']:.0f} GB/s**; weights on this rank {meta['weights_gib']:.1f} GiB "
        f"(draft {meta['draft_gib']:.2f} GiB); {meta['input_len']} in / {meta['output_len']} out; "
        f"decode windows of {meta['window']} steps at contexts ~{meta['input_len']} and "
        f"~{meta['input_len'] + meta['output_len']}, "
        "averaged. Collectives are NOT in the step times (simulated rank): on paper beside them.",
        "",
        "| mode | B | accept. len | step ms (1k / 2k) | tok/s/user | total tok/s | vs off | roofline ms | % roofline "
        "| collectives/step | on paper ms: " + " / ".join(meta["bus_gbps"]) + " |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        near, far = r["windows"]
        acc = r["tokens_per_step"]
        base = off.get(r["batch"])
        vs = f"{r['tokens_per_s_user'] / base['tokens_per_s_user']:.2f}x" if base else "-"
        c = r["collectives"]
        lines.append(f"| {r['mode']} | {r['batch']} | {acc:.2f} | {r['step_ms']:.2f} ({near['step_ms']:.2f} / "
                     f"{far['step_ms']:.2f}) | {r['tokens_per_s_user']:.1f} | {r['tokens_per_s_total']:.0f} | {vs} | "
                     f"{r['roofline_ms']:.2f} | {100 * r['roofline_fraction']:.0f}% | "
                     f"{c['all_reduces']} AR + {c['all_gathers']} AG | "
                     + " / ".join(f"{v:.3f}" for v in c["ms"].values()) + " |")
    for r in rows:
        prof = r["windows"][0].get("profile")
        if not prof:
            continue
        lines += ["", f"Profile, {r['mode']} B={r['batch']} ({prof['steps']} steps at ~{meta['input_len']} context, "
                      f"device-only torch.profiler): {prof['wall_ms_per_step']:.2f} ms a step under the profiler, GPU "
                      f"busy {prof['gpu_busy_ms_per_step']:.2f} ms, idle {prof['gpu_idle_fraction']:.1%}, "
                      f"{prof['kernels_per_step']:.0f} kernels a step", "",
                  "| kernel | µs / step | calls / step | µs / call |", "|---|---:|---:|---:|"]
        lines += [f"| `{t['name']}` | {t['us_per_step']:.0f} | {t['calls_per_step']:.0f} | "
                  f"{t['us_per_step'] / t['calls_per_step']:.1f} |" for t in prof["top_kernels"]]
    if result.get("prefill"):
        p = result["prefill"]
        lines += ["", f"Prefill: {p['tokens']} prompt tokens of {p['batch']} requests in {p['seconds']:.2f} s: "
                      f"**{p['tokens_per_s']:.0f} tokens/s** on this rank (speculation off)."]
    lines += ["", "Collectives on paper: ring bytes (all-reduce x 2(N-1)/N, all-gather x (N-1)/N) / peak "
                  "unidirectional bus bandwidth " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in meta["bus_gbps"].items())
              + "; per-collective latency (several µs each, dominant at small B) is not included.",
              "", f"Anchors (other hardware, not comparable one to one): {ANCHORS}"]
    if result.get("skipped"):
        lines += ["", f"Skipped (out of time): {', '.join(result['skipped'])}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(r["mode"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        ax.plot([r["batch"] for r in rows], [r["tokens_per_s_user"] for r in rows], marker="o",
                label="no speculation" if mode == "off" else f"EAGLE3 {mode}, acc. {rows[0]['tokens_per_step']:.2f}")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in result["rows"]})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("concurrency (requests)")
    ax.set_ylabel("tokens/s per user (decode)")
    meta = result["meta"]
    ax.set_title(f"Kimi-K2.5-MXFP4, one TP{meta['tp']} rank, {meta['device']}\n"
                 "collectives excluded (simulated rank)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_report(result: dict, out_dir: Path) -> str:
    text = markdown(result)
    (out_dir / "bench_kimi.md").write_text(text)
    plot(result, out_dir / "bench_kimi.png")
    return text
