"""ci/bench_adaptive.py's report: per-point verdicts against the issue's goals, the markdown tables
and the PNG plot of a bench_adaptive.json result; and results of one benchmark split over several
device calls (each a part or some batches: a call may run 10 minutes), merged:

    python ci/bench_adaptive_report.py merge a/bench_adaptive.json b/bench_adaptive.json --out merged
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path


def pair_rates(tokens: list[int], seconds: list[float]) -> list[float]:
    """Tokens/s of each pair of rounds (one forwards, the next backwards) from each round's tokens
    and seconds: a pair puts every mode at the same mean position in the round."""
    return [(tokens[i] + tokens[i + 1]) / (seconds[i] + seconds[i + 1]) for i in range(0, len(tokens) - 1, 2)]


def _pair_ratios(a: dict, b: dict) -> list[float]:
    def rates(row):
        tokens = row["round_tokens"]
        return pair_rates(tokens, [t / r for t, r in zip(tokens, row["round_tokens_per_s"])])
    return [x / y for x, y in zip(rates(a), rates(b))]


def paired(a: dict, b: dict) -> float:
    """Mode a's tokens/s over mode b's, as the median over pairs of rounds of the two modes' ratio
    in that pair. Both ran in the same rounds minutes apart at most, so a slow phase of the host
    falls on both; the ratio of each mode's own median (`tokens_per_s`) compares pairs from
    different minutes (2026-11-27, SmolLM2 pair on an H100: a point's turns moved by up to 2x
    within a minute, every mode alike)."""
    return statistics.median(_pair_ratios(a, b))


def paired_interval(a: dict, b: dict, resamples: int = 1000) -> tuple[float, float]:
    """A 95% interval of `paired`: the 2.5th and 97.5th percentiles of the median over pairs
    resampled with replacement (seeded: a report is reproducible). Why: a zoo point's pair ratios
    spread by 0.2-0.4 (sd; SmolLM2 pair on an H100, batch 1, 96 pairs), which puts a point's
    paired ratio within about +-5%, the width of the issue's goal (2026-11-27)."""
    ratios = _pair_ratios(a, b)
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def verdicts(rows: list[dict], key: str) -> list[dict]:
    """Per point and adaptive mode: it against no speculation and the best fixed k (the issue's
    goals: >= 0.98x, >= 0.95x), from each mode's tokens/s and as paired ratios (`paired`; the best
    fixed k then the one with the highest paired ratio to k = 0)."""
    points = {}
    for r in rows:
        points.setdefault((r["batch"], r[key]), {})[r["mode"]] = r
    out = []
    for (bs, x), modes in sorted(points.items()):
        fixed = {m: r for m, r in modes.items() if m.startswith("k=") and m != "k=0"}
        best = max(fixed, key=lambda m: fixed[m]["tokens_per_s"])
        off = modes["k=0"]["tokens_per_s"]  # no speculation on the same batch (see interleaved)
        best_paired = max(fixed, key=lambda m: paired(fixed[m], modes["k=0"]))
        for mode in [m for m in modes if m.startswith("adaptive")]:
            a = modes[mode]["tokens_per_s"]
            out.append(dict(batch=bs, **{key: x}, policy=mode, off=off, best_fixed=best,
                            best_fixed_tps=fixed[best]["tokens_per_s"], adaptive=a, adaptive_k=modes[mode]["mean_k"],
                            vs_off=a / off, vs_best=a / fixed[best]["tokens_per_s"],
                            vs_off_paired=paired(modes[mode], modes["k=0"]), best_fixed_paired=best_paired,
                            vs_best_paired=paired(modes[mode], fixed[best_paired]),
                            vs_off_paired_95=paired_interval(modes[mode], modes["k=0"]),
                            vs_best_paired_95=paired_interval(modes[mode], fixed[best_paired]),
                            plain_vs_k0=modes["off"]["vs_k0_same_context"]))
    return out


def _with_interval(verdict: dict, key: str) -> str:
    low, high = verdict[f"{key}_95"]
    return f"{verdict[key]:.2f}x [{low:.2f}, {high:.2f}]"


def markdown(out: dict) -> str:
    meta = out["meta"]
    lines = [f"### Adaptive draft length ({meta['device']}, {meta['date']})", "",
             f"`{meta['command']}`; k at most {meta['k']}; modes interleaved on one batch a point: {meta['warm']} untimed "
             f"steps of every mode first ({meta['adaptive_warm']} more of each adaptive policy), then "
             f"{meta['rounds']} turns a mode of {meta['settle']} untimed + {meta['window']} timed steps "
             f"(zoo: {meta['zoo_rounds']} turns of {meta['zoo_window']}, {meta.get('zoo_sets', 1)} batch(es) of prompts a "
             f"point in turn; below batch {meta.get('zoo_min_seqs', 1)}, that many sequences' worth of batches), modes "
             "forwards then backwards; tokens/s is the "
             "median over pairs of rounds; "
             "step costs: " + ", ".join(f"{part} {meta[f'{part}_step_costs']['source']}" for part in ("forced", "zoo")
                                        if f"{part}_step_costs" in meta) + ".", ""]
    for part, key, title in (("forced", "forced", "forced accepted drafts m"), ("zoo", "temperature", "temperature")):
        if not out.get(part):
            continue
        modes = [m for m in dict.fromkeys(r["mode"] for r in out[part]) if m != "off"]
        policies = [m for m in modes if m.startswith("adaptive")]
        lines += [f"#### {part}: tokens/s ({title})", "",
                  "No speculation is k = 0 on the speculative engine, in turns with the other modes on the same "
                  "batch; the last column is the plain engine's tokens/s over k = 0's right after both prefilled "
                  "the same prompts.", "",
                  f"| batch | {title} | " + " | ".join("no spec (k=0)" if m == "k=0" else m for m in modes)
                  + "".join(f" | {p}: mean k, / no spec, / best fixed | paired [95%]: / no spec, / best fixed" for p in policies)
                  + " | plain / k=0 |",
                  "|---|---|" + "---|" * (len(modes) + 2 * len(policies) + 1)]
        v = {(r["batch"], r[key], r["policy"]): r for r in verdicts(out[part], key)}
        points = {}
        for r in out[part]:
            points.setdefault((r["batch"], r[key]), {})[r["mode"]] = r["tokens_per_s"]
            if r["mode"] == "off":
                points[r["batch"], r[key]]["off_vs_k0"] = r["vs_k0_same_context"]
        for (bs, x), tps in sorted(points.items()):
            # (merged runs may differ in their --policy-b modes: a mode a point lacks is "-")
            cells = [f"{v[bs, x, p]['adaptive_k']:.2f}, {v[bs, x, p]['vs_off']:.2f}x, {v[bs, x, p]['vs_best']:.2f}x "
                     f"({v[bs, x, p]['best_fixed']}) | {_with_interval(v[bs, x, p], 'vs_off_paired')}, "
                     f"{_with_interval(v[bs, x, p], 'vs_best_paired')} ({v[bs, x, p]['best_fixed_paired']})"
                     if (bs, x, p) in v else "- | -" for p in policies]
            lines.append(f"| {bs} | {x} | " + " | ".join(f"{tps[m]:.0f}" if m in tps else "-" for m in modes)
                         + "".join(f" | {c}" for c in cells) + f" | {tps['off_vs_k0']:.3f}x |")
        lines.append("")
        for p in policies:
            mine = [r for r in v.values() if r["policy"] == p]
            lines.append(f"Worst point of {p}: {min(r['vs_off'] for r in mine):.2f}x no speculation (goal >= 0.98x), "
                         f"{min(r['vs_best'] for r in mine):.2f}x the best fixed k (goal >= 0.95x); paired ratios: "
                         f"{min(r['vs_off_paired'] for r in mine):.2f}x, {min(r['vs_best_paired'] for r in mine):.2f}x; "
                         + "; ".join(f"{what}: 95% interval below the goal at {sum(r[f'{k}_95'][1] < goal for r in mine)} "
                                     f"of {len(mine)} points, above it at {sum(r[f'{k}_95'][0] >= goal for r in mine)}"
                                     for what, k, goal in (("/ no spec", "vs_off_paired", 0.98),
                                                           ("/ best fixed", "vs_best_paired", 0.95))) + ".")
        odd = [f"batch {r['batch']} {key} {r[key]} {r['mode']}: {r['eager_steps']} eager steps, {r['gc2']} full GCs "
               f"({r['gc2_ms']:.0f} ms), k {r['k_steps']}" for r in out[part] if r["eager_steps"] or r["gc2"]]
        lines += ["", "Timed windows with eager steps or full garbage collections: " + ("; ".join(odd) or "none"), ""]
    if meta.get("zoo_skipped"):
        lines += [f"zoo part skipped: {meta['zoo_skipped']}", ""]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    panels = [("forced", "forced", m) for m in sorted({r["forced"] for r in out.get("forced", [])})]
    panels += [("zoo", "temperature", t) for t in sorted({r["temperature"] for r in out.get("zoo", [])})]
    if not panels:
        return False
    cols = min(4, len(panels))
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(4 * cols, 3.2 * ((len(panels) + cols - 1) // cols)),
                             squeeze=False)
    for ax, (part, key, x) in zip(axes.flat, panels):
        rows = [r for r in out[part] if r[key] == x]
        for mode in [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "off"]:  # (off: another context)
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["mode"] == mode)
            style = (dict(linewidth=2.5, color="black" if mode == "adaptive" else "grey") if mode.startswith("adaptive")
                     else dict(linestyle="--" if mode == "k=0" else "-"))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                    label="no speculation (k=0)" if mode == "k=0" else mode, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{'8B shape, forced m' if part == 'forced' else 'SmolLM2 pair, T'} = {x}", fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_report(out: dict, out_dir: Path) -> str:
    """Verdicts into `out`; bench_adaptive.json, .md and .png into out_dir; the markdown returned."""
    for part, key in (("forced", "forced"), ("zoo", "temperature")):
        if out.get(part):
            out[f"{part}_verdicts"] = verdicts(out[part], key)
    (out_dir / "bench_adaptive.json").write_text(json.dumps(out, indent=1))
    text = markdown(out)
    (out_dir / "bench_adaptive.md").write_text(text)
    plot(out, out_dir / "bench_adaptive.png")
    return text


def merge(outs: list[dict]) -> dict:
    """One result from several calls' results: their points together (a point measured twice is
    refused), the first call's meta with every call's command, device and seconds."""
    merged = {"meta": {**outs[0]["meta"], "calls": [{k: o["meta"].get(k) for k in ("command", "device", "seconds")}
                                                    for o in outs]}}
    merged["meta"]["seconds"] = sum(o["meta"]["seconds"] for o in outs)
    for part, key in (("forced", "forced"), ("zoo", "temperature")):
        rows = [r for o in outs for r in o.get(part, [])]
        seen = [(r["batch"], r[key], r["mode"]) for r in rows]
        if len(set(seen)) != len(seen):
            raise ValueError(f"{part}: a point is in more than one result: {sorted(p for p in set(seen) if seen.count(p) > 1)}")
        if rows:
            merged[part] = rows
        for meta_key in (f"{part}_step_costs", f"{part}_skipped"):  # from the call that ran the part
            value = next((o["meta"][meta_key] for o in outs if o["meta"].get(meta_key) is not None), None)
            if value is not None:
                merged["meta"][meta_key] = value
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge the results of one benchmark split over several calls")
    m.add_argument("results", nargs="+", type=Path)
    m.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(write_report(merge([json.loads(p.read_text()) for p in args.results]), args.out))


if __name__ == "__main__":
    main()
