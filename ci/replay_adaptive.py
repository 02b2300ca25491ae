"""Replay the adaptive draft-length policy against the conditions a GPU zoo run recorded (issue 19), on the CPU.

Why: the zoo part of ci/bench_adaptive.py costs ~16 minutes of GPU time a verdict, and one run moves a point by a
few percent; the misses it found come from the GPU host's slow phases (prices taken hundreds of steps apart, in
phases up to 2x apart). The run's JSON keeps what each fixed mode's turns saw: per round (one turn of every mode,
adjacent in time), its tokens and their tokens/s. This puts a policy through the same turns (SETTLE untimed and
TIMED timed steps a round, its calls as the engine makes them: choose; observe with the verifications' lag;
observe_step only for steady steps and not in a turn's first FRESH steps, as bench_adaptive's Rotation):
- a step at k in round w costs k = 0's mean step of round w times R_k, k's median ratio to k = 0 over all rounds
  (one phase for every k, as the run's rounds show: the ks' step times correlate 0.7-0.8 within a round, and k = 0's
  from one round to the next alike), times lognormal noise;
- each sequence accepts draft i with a per-position rate fitted per prompt set to the fixed modes' acceptance.
The fixed modes go through the same replay; ratios are paired by rounds as in the benchmark.

    python ci/replay_adaptive.py RUN.json [RUN.json ...] [--points 1:0,64:1] [--seeds 16] [--policy-b FILE ...]
        [--policy-overhead-us 5,60]

Not a measurement of the engine: a check of a policy's decisions under the recorded phases (what a change of k costs
the steps after it is not in it, and its host time only as a constant, --policy-overhead-us). docs/benchmarks.md section 11, "Replaying the policy".
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode.adaptive import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength  # noqa: E402
from spec_decode.step_costs import StepCosts  # noqa: E402

SETTLE, TIMED, FRESH = 3, 5, 2  # bench_adaptive's zoo turns (--settle, --zoo-window) and Rotation.FRESH_STEPS
NOISE = 0.08  # lognormal sigma of a step around its round's cost


def conditions(run: dict, batch: int, temperature: float, profile_runs: list[dict]):
    """(cost[k][round] seconds, per-position acceptance rates per prompt set, rounds a set, the profile, measured rows)."""
    rows = {r["mode"]: r for r in run["zoo"] if r["batch"] == batch and r["temperature"] == temperature}
    kmax = run["meta"]["k"]
    # a round's mean step (its time over its steps), not its median: the benchmark divides tokens by time
    mean_step = {k: [t / tps / TIMED for t, tps in zip(rows[f"k={k}"]["round_tokens"], rows[f"k={k}"]["round_tokens_per_s"])]
                 for k in range(kmax + 1)}
    cost = []
    for k in range(kmax + 1):
        ratio = statistics.median(c / c0 for c, c0 in zip(mean_step[k], mean_step[0]))
        cost.append([ratio * c0 for c0 in mean_step[0]])
    sets = run["meta"]["zoo_sets"]
    per_set = len(cost[0]) // sets
    rates = []
    for s in range(sets):
        # E[accepted | k] of the set from the fixed modes' tokens, made monotone in k, then a_i from its increments
        e = [0.0]
        for k in range(1, kmax + 1):
            tokens = rows[f"k={k}"]["round_tokens"][s * per_set:(s + 1) * per_set]
            e.append(max(e[-1], statistics.mean(t / (TIMED * batch) - 1 for t in tokens)))
        a, reach = [], 1.0
        for i in range(1, kmax + 1):
            a.append(min(max((e[i] - e[i - 1]) / reach if reach > 1e-9 else 0.0, 0.02), 0.98))
            reach *= a[-1]
        rates.append(a)
    # a merged run keeps one part's start-up profile: take the first that has this batch's bucket
    for source in [run, *profile_runs]:
        costs = source["meta"].get("zoo_step_costs")
        if costs and costs["buckets"][-1] >= batch:
            break
    profile = StepCosts(costs["buckets"], costs["seconds"], costs["source"])
    return cost, rates, per_set, profile, rows


def replay(policy: DraftLengthPolicy, cost, rates, per_set: int, batch: int, seed: int,
           overhead: tuple[float, float] | None = None) -> list[tuple[int, float]]:
    """(tokens, seconds) of each round's timed steps. `overhead` (adaptive policies only): their own host time, on a
    host-bound step: seconds added to every step, and more to a step whose choice was worked out afresh
    (AdaptiveDraftLength holds its choice HOLD steps and more in between: a new `_held`)."""
    rng = random.Random(seed)
    own, proposed, out = 0, 0, []
    for w in range(len(cost[0])):
        a, fresh, before, tokens, seconds = rates[w // per_set], FRESH, [None, None], 0, 0.0
        for i in range(SETTLE + TIMED):
            held = policy._held if overhead else None
            k = policy.choose(own, batch)
            fresh -= 1
            period = cost[k][w] * math.exp(rng.gauss(0.0, NOISE))
            if overhead:
                period += overhead[0] + (overhead[1] if policy._held != held else 0.0)
            accepted = [0] * batch  # this step verifies what the one before proposed
            for j in range(batch if proposed else 0):
                while accepted[j] < proposed and rng.random() < a[accepted[j]]:
                    accepted[j] += 1
            if proposed:
                policy.observe(own, [proposed] * batch, accepted)
            if fresh < 0 and before[0] == before[1] == k:
                policy.observe_step(batch, k, period)
            if i >= SETTLE:
                tokens, seconds = tokens + batch + sum(accepted), seconds + period
            before, proposed, own = [before[1], k], k, own + 1
        out.append((tokens, seconds))
    return out


def paired(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float:
    """Median over pairs of rounds of a's tokens/s over b's (bench_adaptive's paired ratio)."""
    rate = lambda r, i: (r[i][0] + r[i + 1][0]) / (r[i][1] + r[i + 1][1])
    return statistics.median(rate(a, i) / rate(b, i) for i in range(0, len(a) - 1, 2))


def replay_point(run: dict, batch: int, temperature: float, policies: dict, seeds: int, profile_runs: list[dict],
                 overhead: tuple[float, float] | None = None) -> dict:
    """Per policy: mean over seeds of its paired ratio to no speculation (k = 0) and to the best fixed k."""
    cost, rates, per_set, profile, rows = conditions(run, batch, temperature, profile_runs)
    kmax = run["meta"]["k"]
    out = {name: {"vs_off": [], "vs_best": []} for name in policies}
    fixed_tps = {k: [] for k in range(kmax + 1)}
    for seed in range(seeds):
        fixed = {k: replay(FixedDraftLength(k), cost, rates, per_set, batch, 1000 * seed + k) for k in range(kmax + 1)}
        tps = {k: sum(t for t, _ in r) / sum(s for _, s in r) for k, r in fixed.items()}
        for k, v in tps.items():
            fixed_tps[k].append(v)
        best = max(tps, key=tps.get)
        for name, make in policies.items():
            r = replay(make(kmax, profile), cost, rates, per_set, batch, 1000 * seed + 999, overhead)
            out[name]["vs_off"].append(paired(r, fixed[0]))
            out[name]["vs_best"].append(paired(r, fixed[best]))
    return dict(batch=batch, temperature=temperature,
                measured={m: r["tokens_per_s"] for m, r in rows.items()},
                replayed_fixed={f"k={k}": statistics.mean(v) for k, v in fixed_tps.items()},
                policies={name: {key: statistics.mean(v) for key, v in r.items()} for name, r in out.items()})


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="bench_adaptive JSON files with a zoo part")
    parser.add_argument("--points", default="", help="batch:temperature,... (default: every zoo point of each run)")
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--policy-b", action="append", default=[], help="a saved spec_decode/adaptive.py (repeatable)")
    parser.add_argument("--policy-overhead-us", default="0,0",
                        help="STEP,CHOICE: µs of an adaptive policy's host time added to each of its steps, and more to "
                             "each step whose choice it worked out afresh")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    policies = {"adaptive": AdaptiveDraftLength}
    if args.policy_b:
        from gpu_timing import load_kernel_version

        for path in args.policy_b:
            policies[f"adaptive-{Path(path).stem}"] = load_kernel_version(
                Path(path), f"adaptive_{Path(path).stem}", package="spec_decode").AdaptiveDraftLength
    loaded = [json.loads(p.read_text()) for p in args.runs]
    wanted = {(int(b), float(t)) for b, t in (p.split(":") for p in args.points.split(",") if p)}
    results = []
    for path, run in zip(args.runs, loaded):
        points = sorted({(r["batch"], r["temperature"]) for r in run["zoo"]})
        for batch, temperature in points:
            if wanted and (batch, temperature) not in wanted:
                continue
            r = replay_point(run, batch, temperature, policies, args.seeds, loaded,
                             tuple(float(x) * 1e-6 for x in args.policy_overhead_us.split(",")))
            results.append(dict(run=path.name, **r))
            line = ", ".join(f"{name} {p['vs_off']:.3f} / {p['vs_best']:.3f}" for name, p in r["policies"].items())
            fit = max(abs(r["replayed_fixed"][m] / r["measured"][m] - 1) for m in r["replayed_fixed"])
            print(f"{path.name} batch {batch} T {temperature}: (vs no spec / vs best fixed) {line}; fixed ks replayed "
                  f"within {fit:.1%} of the GPU's", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
